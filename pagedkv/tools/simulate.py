"""`pagedkv simulate`: the reference article's capacity experiment, run through
the real allocator core and the contiguous baseline.

A KV pool of `--pool-gib` GiB at `--bytes-per-token` bytes per token holds
pool_gib * 2^30 / bytes_per_token token slots. `--requests` request lengths are
drawn uniformly from [--min-len, --max-len] with `--seed`; each request is
counted at its final length and admitted in arrival order until the next one
does not fit.

- contiguous: each request reserves `--reserve` slots in a row (first fit);
- paged: each request takes ceil(length / block_size) blocks from the core.

This is a MEMORY effect (how many requests fit), not a speed benchmark.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass

from allocator_service.core import BlockPool, ContiguousPool, OutOfBlocks, PoolConfig
from pagedkv.cli import CliError

GIB = 1 << 30


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


def draw_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def simulate_contiguous(num_slots: int, lengths: list[int], reserve: int) -> ContiguousResult:
    pool = ContiguousPool(num_slots)
    admitted = 0
    for i, n in enumerate(lengths):
        # A request longer than the reservation cannot be served at all.
        if n > reserve or pool.reserve(f"r{i}", reserve, used=n) is None:
            break
        admitted += 1
    reserved, used = pool.reserved_slots, pool.used_slots
    return ContiguousResult(admitted, reserved, used, reserved - used, used / reserved if reserved else 0.0)


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
    p.add_argument("--bytes-per-token", type=int, default=131072, help="KV bytes per token (default 131,072: Llama 3 8B fp16)")
    p.add_argument("--reserve", type=int, default=8192, help="contiguous slots reserved per request (default 8,192)")
    p.add_argument("--requests", type=int, default=500, help="requests in the stream (default 500)")
    p.add_argument("--min-len", type=int, default=100, help="shortest request in tokens (default 100)")
    p.add_argument("--max-len", type=int, default=2000, help="longest request in tokens (default 2,000)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the lengths (default 0)")
    p.add_argument("--block-size", type=int, default=16, help="block size of the paged layout (default 16)")
    p.add_argument("--block-sizes", help="comma-separated block sizes to sweep, e.g. 1,2,4,8,16")
    p.add_argument("--plot", metavar="FILE.png", help="draw admitted requests per block size to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _check(args: argparse.Namespace) -> list[int]:
    if args.pool_gib <= 0 or args.bytes_per_token <= 0 or args.reserve <= 0 or args.requests <= 0:
        raise CliError("--pool-gib, --bytes-per-token, --reserve and --requests must be positive")
    if not 1 <= args.min_len <= args.max_len:
        raise CliError("need 1 <= --min-len <= --max-len")
    sizes = [args.block_size]
    if args.block_sizes:
        try:
            sizes = [int(x) for x in args.block_sizes.split(",") if x.strip()]
        except ValueError:
            raise CliError(f"--block-sizes must be comma-separated integers, got {args.block_sizes!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise CliError("block sizes must be positive integers")
    return sizes


def run(args: argparse.Namespace) -> int:
    sizes = _check(args)
    num_slots = int(args.pool_gib * GIB) // args.bytes_per_token
    lengths = draw_lengths(args.requests, args.min_len, args.max_len, args.seed)
    contiguous = simulate_contiguous(num_slots, lengths, args.reserve)
    sweep = [simulate_paged(num_slots, lengths, b) for b in sizes]
    main = next((r for r in sweep if r.block_size == args.block_size), sweep[-1])
    out = {
        "pool_slots": num_slots,
        "requests": args.requests,
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
        title=f"{args.requests} requests of {args.min_len}-{args.max_len} tokens, pool of "
        f"{num_slots:,} slots ({args.pool_gib:g} GiB at {args.bytes_per_token:,} B/token)",
        caption="a memory effect, not a speed benchmark",
    )
    for col in ("layout", "admitted", "slots reserved/allocated", "slots holding tokens", "wasted", "used"):
        table.add_column(col, justify="right")
    c = out["contiguous"]
    table.add_row(
        f"contiguous ({args.reserve:,}/request)", str(c["admitted"]), f"{c['reserved_slots']:,}",
        f"{c['used_slots']:,}", f"{c['wasted_slots']:,}", f"{c['used_fraction']:.1%}",
    )
    for r in out["sweep"]:
        table.add_row(
            f"paged, block {r['block_size']}", str(r["admitted"]), f"{r['allocated_slots']:,}",
            f"{r['used_slots']:,}", f"{r['wasted_slots']:,}", f"{r['used_fraction']:.1%}",
        )
    Console(width=120).print(table)
    if out.get("plot"):
        print(f"chart: {out['plot']}")


def plot(path: str, contiguous: ContiguousResult, sweep: list[PagedResult], args: argparse.Namespace) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [str(r.block_size) for r in sweep]
    bars = ax.bar(xs, [r.admitted for r in sweep], color="#3b7dd8", label="paged (blocks)")
    ax.bar_label(bars)
    ax.axhline(contiguous.admitted, color="#d8643b", linestyle="--",
               label=f"contiguous, {args.reserve:,} slots reserved each ({contiguous.admitted})")
    ax.set_xlabel("block size (token slots per block)")
    ax.set_ylabel("requests admitted")
    ax.set_title("Requests that fit in the KV pool (a memory effect, not a speed benchmark)", fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
