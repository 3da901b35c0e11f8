"""Element types and the KV-cache size formula, without torch.

One table of dtype names for everything that reads one (the worker's
`--dtype`, `load_model`, `pagedkv kv-size`) and one formula for the bytes a
token's K/V costs (the KV pool's budget, `pagedkv kv-size`). Torch-free on
purpose: `pagedkv kv-size` imports this and stays instant.
"""

from __future__ import annotations

__all__ = [
    "DTYPE_ALIASES",
    "DTYPE_BYTES",
    "ELEMENT_BYTES",
    "WORKER_DTYPES",
    "canonical_dtype",
    "kv_bytes_per_token",
]

# Bytes per element of each element type, by its torch name.
ELEMENT_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
# Other spellings found in configs and on command lines.
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "float8": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
}
# Every known spelling -> bytes per element.
DTYPE_BYTES: dict[str, int] = {
    **ELEMENT_BYTES,
    **{alias: ELEMENT_BYTES[name] for alias, name in DTYPE_ALIASES.items()},
}
# The element types the worker computes in and keeps its K/V in.
WORKER_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")


def canonical_dtype(name: str) -> str | None:
    """The torch name of the element type spelled `name`, or None if unknown."""
    if name in ELEMENT_BYTES:
        return name
    return DTYPE_ALIASES.get(name)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int) -> int:
    """Bytes one token's K/V costs: K and V, in every layer, every KV head."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element
