"""`pagedkv kv-size`: KV-cache bytes per token from a Hugging Face config.json.

bytes/token = 2 (K and V) x num_hidden_layers x num_key_value_heads x head_dim
x bytes per element (the model's dtype, or the worker's `--kv-cache-dtype`:
one byte for fp8). `num_key_value_heads` defaults to `num_attention_heads`
(no grouped-query attention); `head_dim` is taken when the config has it, else
hidden_size / num_attention_heads.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from pagedkv_base.settings import CliError
from worker.kv_bytes import DTYPE_BYTES, kv_bytes_per_token, kv_cache_element, kv_dims_from_config

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVSize:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_element: int
    bytes_per_token: int
    max_context: int | None


def kv_size_from_config(
    cfg: dict, dtype: str | None = None, kv_cache_dtype: str = "auto"
) -> KVSize:
    """`dtype`: the model's (default: the config's); `kv_cache_dtype`: the worker's flag."""
    try:
        layers, kv_heads, head_dim = kv_dims_from_config(cfg)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = cfg["text_config"]
    name = (dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "float16").lower()
    if name not in DTYPE_BYTES:
        raise CliError(f"unknown dtype {name!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    try:
        name = kv_cache_element(kv_cache_dtype, name)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    per_elem = DTYPE_BYTES[name]
    max_ctx = cfg.get("max_position_embeddings")
    return KVSize(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=name,
        bytes_per_element=per_elem,
        bytes_per_token=kv_bytes_per_token(layers, kv_heads, head_dim, per_elem),
        max_context=max_ctx if type(max_ctx) is int and max_ctx > 0 else None,
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "kv-size",
        help="KV-cache bytes per token of a model, from its config.json",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", metavar="CONFIG_JSON", help="a Hugging Face config.json")
    p.add_argument(
        "--dtype", help="KV element type (default: the config's torch_dtype, else float16)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="auto|fp8|fp8_e4m3|fp8_e5m2",
        help="the worker's --kv-cache-dtype: 'auto' (the dtype above) or an fp8 format (1 byte)",
    )
    p.add_argument("--tokens", type=int, help="also print the cache size of this many tokens")
    p.add_argument(
        "--gib", type=float, help="also print how many full-context sequences fit in this many GiB"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        with open(args.config, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except OSError as exc:
        raise CliError(f"cannot read {args.config}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"{args.config} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise CliError(f"{args.config} is not a JSON object")
    if args.tokens is not None and args.tokens < 0:
        raise CliError("--tokens must be >= 0")
    if args.gib is not None and args.gib <= 0:
        raise CliError("--gib must be > 0")
    size = kv_size_from_config(cfg, args.dtype, args.kv_cache_dtype)
    out = asdict(size)
    if args.tokens is not None:
        out["tokens"] = args.tokens
        out["bytes_for_tokens"] = args.tokens * size.bytes_per_token
    if args.gib is not None:
        out["gib"] = args.gib
        budget_tokens = int(args.gib * GIB) // size.bytes_per_token
        out["tokens_in_budget"] = budget_tokens
        if size.max_context:
            out["bytes_per_full_sequence"] = size.max_context * size.bytes_per_token
            out["full_sequences_in_budget"] = budget_tokens // size.max_context
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"KV cache: 2 x {size.num_layers} layers x {size.num_kv_heads} kv heads x "
        f"{size.head_dim} head dim x {size.bytes_per_element} B ({size.dtype}) = "
        f"{size.bytes_per_token:,} bytes per token ({human_bytes(size.bytes_per_token)})"
    )
    if "bytes_for_tokens" in out:
        print(f"{args.tokens:,} tokens: {human_bytes(out['bytes_for_tokens'])}")
    if "tokens_in_budget" in out:
        line = f"{args.gib:g} GiB holds {out['tokens_in_budget']:,} tokens"
        if "full_sequences_in_budget" in out:
            line += (
                f" = {out['full_sequences_in_budget']:,} full-context sequences of "
                f"{size.max_context:,} tokens ({human_bytes(out['bytes_per_full_sequence'])} each)"
            )
        print(line)
    return 0
