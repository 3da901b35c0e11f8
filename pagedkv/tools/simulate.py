"""`pagedkv simulate`: the reference article's capacity experiment, run through
the real allocator core and the contiguous baseline.

A KV pool of `--pool-gib` GiB at `--bytes-per-token` bytes per token holds
pool_gib * 2^30 / bytes_per_token token slots. `--requests` request lengths are
drawn uniformly from [100, 2000] inclusive with NumPy's
`np.random.default_rng(0).integers(100, 2001, size=requests)`, the article's
draw; each request is counted at its final length and admitted in arrival
order until the next one does not fit.

The defaults (16 GiB at 131,072 B/token, 8,192 reserved per request, 500
requests) reproduce the article's figures exactly: 16 contiguous admitted
using 12.9% of 131,072 reserved slots, and 122 paged at block size 16 (8,175
blocks = 130,800 slots, 913 wasted). The lengths are an invented workload, not
a measurement.

- contiguous: each request reserves `--reserve` slots in a row (first fit);
- paged: each request takes ceil(length / block_size) blocks from the core, at
  every block size from 1 to 16 (the headline, the JSON `paged` key: 16).

`--kv-cache-dtype fp8` (the worker's flag) stores K/V in one byte per element
instead of the two `--bytes-per-token` is counted in: the same pool holds
twice the token slots.

This is a MEMORY effect (how many requests fit), not a speed benchmark.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from allocator_service.core import BlockPool, ContiguousPool, OutOfBlocks, PoolConfig
from pagedkv_base.settings import CliError
from worker.kv_bytes import DTYPE_BYTES, KV_CACHE_DTYPES, kv_cache_element

GIB = 1 << 30
BYTES_PER_ELEMENT = 2  # what --bytes-per-token is counted in (float16 / bfloat16)


@dataclass(frozen=True, slots=True)
class ContiguousResult:
    admitted: int
    reserved_slots: int
    used_slots: int
    wasted_slots: int
    used_fraction: float


@dataclass(frozen=True, slots=True)
class PagedResult:
    block_size: int
    admitted: int
    allocated_slots: int
    used_slots: int
    wasted_slots: int
    used_fraction: float


# The article's workload and its sweep.
MIN_LEN, MAX_LEN, SEED = 100, 2000, 0
BLOCK_SIZES = tuple(range(1, 17))
BLOCK_SIZE = 16  # the headline result


def draw_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """n lengths uniform on [lo, hi] inclusive: the article's generator, so seed 0
    with the defaults gives its figures to the slot."""
    import numpy as np

    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi + 1, size=n)]


def simulate_contiguous(num_slots: int, lengths: list[int], reserve: int) -> ContiguousResult:
    pool = ContiguousPool(num_slots)
    admitted = 0
    for i, n in enumerate(lengths):
        # A request longer than the reservation cannot be served at all.
        if n > reserve or pool.reserve(f"r{i}", reserve, used=n) is None:
            break
        admitted += 1
    reserved, used = pool.reserved_slots, pool.used_slots
    return ContiguousResult(
        admitted, reserved, used, reserved - used, used / reserved if reserved else 0.0
    )


def simulate_paged(num_slots: int, lengths: list[int], block_size: int) -> PagedResult:
    pool = BlockPool(PoolConfig(num_blocks=num_slots // block_size, block_size=block_size))
    admitted = 0
    for i, n in enumerate(lengths):
        try:
            pool.admit(f"r{i}", [0] * n)
        except OutOfBlocks:
            break
        admitted += 1
    s = pool.stats()
    assert pool.check_integrity()
    return PagedResult(
        block_size=block_size,
        admitted=admitted,
        allocated_slots=s.slots_allocated,
        used_slots=s.tokens_stored,
        wasted_slots=s.wasted_slots,
        used_fraction=s.tokens_stored / s.slots_allocated if s.slots_allocated else 0.0,
    )


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "simulate",
        help="how many requests fit: paged blocks vs one reserved run per request",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pool-gib", type=float, default=16.0, help="KV pool size in GiB (default 16)")
    p.add_argument(
        "--bytes-per-token",
        type=int,
        default=131072,
        help="KV bytes per token (default 131,072: Llama 3 8B fp16)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="|".join(KV_CACHE_DTYPES),
        help="the worker's --kv-cache-dtype: 'auto' (the 2-byte elements --bytes-per-token counts) "
        "or an fp8 format (1 byte: half the bytes per token)",
    )
    p.add_argument(
        "--reserve",
        type=int,
        default=8192,
        help="contiguous slots reserved per request (default 8,192)",
    )
    p.add_argument("--requests", type=int, default=500, help="requests in the stream (default 500)")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="chart admitted requests and wasted slots "
        "per block size, with the contiguous baseline",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.pool_gib <= 0 or args.bytes_per_token <= 0 or args.reserve <= 0 or args.requests <= 0:
        raise CliError("--pool-gib, --bytes-per-token, --reserve and --requests must be positive")
    try:
        kv_cache_element(args.kv_cache_dtype, "float16")
    except ValueError as exc:
        raise CliError(str(exc)) from None


def bytes_per_token(args: argparse.Namespace) -> int:
    """The pool's bytes per token under `--kv-cache-dtype`."""
    element = DTYPE_BYTES[kv_cache_element(args.kv_cache_dtype, "float16")]
    return args.bytes_per_token * element // BYTES_PER_ELEMENT


def run(args: argparse.Namespace) -> int:
    _check(args)
    per_token = bytes_per_token(args)
    num_slots = int(args.pool_gib * GIB) // per_token
    lengths = draw_lengths(args.requests, MIN_LEN, MAX_LEN, SEED)
    contiguous = simulate_contiguous(num_slots, lengths, args.reserve)
    sweep = [simulate_paged(num_slots, lengths, b) for b in BLOCK_SIZES]
    main = next(r for r in sweep if r.block_size == BLOCK_SIZE)
    out = {
        "pool_slots": num_slots,
        "kv_cache_dtype": args.kv_cache_dtype,
        "bytes_per_token": per_token,
        "requests": args.requests,
        "workload": {
            "generator": "numpy.random.default_rng(seed).integers(min_len, "
            "max_len + 1, size=requests)",
            "seed": SEED,
            "min_len": MIN_LEN,
            "max_len": MAX_LEN,
        },
        "contiguous": asdict(contiguous),
        "paged": asdict(main),
        "sweep": [asdict(r) for r in sweep],
        "ratio_admitted": main.admitted / contiguous.admitted if contiguous.admitted else None,
    }
    if args.plot:
        plot(args.plot, contiguous, sweep, args)
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out, num_slots, args)
    return 0


def print_table(out: dict, num_slots: int, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{args.requests} requests of {MIN_LEN}-{MAX_LEN} tokens (seed {SEED}), pool of "
        f"{num_slots:,} slots ({args.pool_gib:g} GiB at {out['bytes_per_token']:,} B/token)",
        caption="a memory effect, not a speed benchmark",
    )
    for col in (
        "layout",
        "admitted",
        "slots reserved/allocated",
        "slots holding tokens",
        "wasted",
        "used",
    ):
        table.add_column(col, justify="right")
    c = out["contiguous"]
    table.add_row(
        f"contiguous ({args.reserve:,}/request)",
        str(c["admitted"]),
        f"{c['reserved_slots']:,}",
        f"{c['used_slots']:,}",
        f"{c['wasted_slots']:,}",
        f"{c['used_fraction']:.1%}",
    )
    for r in out["sweep"]:
        table.add_row(
            f"paged, block {r['block_size']}",
            str(r["admitted"]),
            f"{r['allocated_slots']:,}",
            f"{r['used_slots']:,}",
            f"{r['wasted_slots']:,}",
            f"{r['used_fraction']:.1%}",
        )
    Console(width=120).print(table)
    if out["ratio_admitted"] is not None:
        print(
            f"paged at block {out['paged']['block_size']} admits {out['ratio_admitted']:.1f}x as "
            f"many requests as contiguous"
        )
    if out.get("plot"):
        print(f"chart: {out['plot']}")


def plot(
    path: str, contiguous: ContiguousResult, sweep: list[PagedResult], args: argparse.Namespace
) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_w) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    xs = [r.block_size for r in sweep]
    bars = ax.bar(xs, [r.admitted for r in sweep], color="#3b7dd8", label="paged (blocks)")
    ax.bar_label(bars, fontsize=7)
    ax.axhline(
        contiguous.admitted,
        color="#d8643b",
        linestyle="--",
        linewidth=2,
        zorder=3,
        label=f"contiguous baseline: {args.reserve:,} slots "
        f"reserved each ({contiguous.admitted} admitted)",
    )
    ax.set_xticks(xs)
    ax.set_xlabel("block size (token slots per block)")
    ax.set_ylabel("requests admitted")
    ax.set_ylim(0, max(r.admitted for r in sweep) * 1.25)
    ax.set_title("Requests that fit in the KV pool", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)

    ax_w.plot(
        xs,
        [r.wasted_slots for r in sweep],
        marker="o",
        color="#3b7dd8",
        label="paged: empty tail slots",
    )
    ax_w.set_xticks(xs)
    ax_w.tick_params(axis="x", labelsize=7)
    ax_w.set_xlabel("block size (token slots per block)")
    ax_w.set_ylabel("wasted slots (allocated, holding no token)")
    ax_w.set_title(
        f"Wasted slots (contiguous wastes {contiguous.wasted_slots:,}, off scale)", fontsize=10
    )
    ax_w.legend(loc="upper left", fontsize=8)

    fig.suptitle(
        "A memory effect, not a speed benchmark: "
        f"{args.requests} invented requests of {MIN_LEN:,}-{MAX_LEN:,} tokens "
        f"(numpy default_rng({SEED})), {args.pool_gib:g} "
        f"GiB pool at {bytes_per_token(args):,} B/token",
        fontsize=9,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
