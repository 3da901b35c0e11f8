"""Element types and the KV-cache size formula, without torch.

One table of dtype names for everything that reads one (the worker's
`--dtype`, `load_model`, `pagedkv kv-size`) and one formula for the bytes a
token's K/V costs (the KV pool's budget, `pagedkv kv-size`). Torch-free on
purpose: `pagedkv kv-size` imports this and stays instant.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "DTYPE_ALIASES",
    "DTYPE_BYTES",
    "ELEMENT_BYTES",
    "FP8_ELEMENTS",
    "KV_CACHE_DTYPES",
    "WORKER_DTYPES",
    "canonical_dtype",
    "KVDims",
    "check_kv_cache_dtype",
    "kv_cache_element",
    "kv_bytes_per_token",
    "kv_dims_from_config",
    "positive_field",
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
# `--kv-cache-dtype` (vLLM's names) -> the K/V element type; None: the model's own dtype.
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
# The 8-bit float element types a KV pool may hold (quantized with a scale: worker/kv_quant.py).
FP8_ELEMENTS: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2")


def canonical_dtype(name: str) -> str | None:
    """The torch name of the element type spelled `name`, or None if unknown."""
    if name in ELEMENT_BYTES:
        return name
    return DTYPE_ALIASES.get(name)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """ValueError (one line) unless `kv_cache_dtype` is a `--kv-cache-dtype` name."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )


def kv_cache_element(kv_cache_dtype: str, model_dtype: str) -> str:
    """The torch name of the element type a KV pool holds under `--kv-cache-dtype`
    (`auto`: the model's dtype, itself a torch name); ValueError for an unknown name."""
    check_kv_cache_dtype(kv_cache_dtype)
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int
) -> int:
    """Bytes one token's K/V costs: K and V, in every layer, every KV head."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


class KVDims(NamedTuple):
    """What a token's K/V size depends on, read from a Hugging Face config.json."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def positive_field(cfg: dict, key: str) -> int:
    """`cfg[key]`, a positive integer, or ValueError naming it."""
    v = cfg.get(key)
    if type(v) is not int or v <= 0:
        raise ValueError(f"config.json: {key} must be a positive integer (got {v!r})")
    return v


def kv_dims_from_config(cfg: dict) -> KVDims:
    """Layers, KV heads and head dim of a config.json (a multimodal one's `text_config`).
    `num_key_value_heads` defaults to `num_attention_heads` (no grouped-query
    attention); `head_dim` to hidden_size / num_attention_heads."""
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = cfg["text_config"]
    layers = positive_field(cfg, "num_hidden_layers")
    heads = positive_field(cfg, "num_attention_heads")
    kv_heads = (
        positive_field(cfg, "num_key_value_heads")
        if cfg.get("num_key_value_heads") is not None
        else heads
    )
    if cfg.get("head_dim") is not None:
        return KVDims(layers, kv_heads, positive_field(cfg, "head_dim"))
    hidden = positive_field(cfg, "hidden_size")
    if hidden % heads:
        raise ValueError(f"config.json: hidden_size {hidden} is not a multiple of {heads} heads")
    return KVDims(layers, kv_heads, hidden // heads)
