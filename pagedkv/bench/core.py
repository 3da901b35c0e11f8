"""`pagedkv bench core`: operations per second of the allocator core.

10,000 sequences (by default) are admitted with a prompt, decoded for a number
of rounds (one token appended per sequence per round, the hot path of a
serving step) and freed, with prefix caching off and on. With caching on,
every prompt starts with the same system prompt, so admits hit the cache.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from allocator_service.core import BlockPool, PoolConfig, blocks_for
from pagedkv.bench.workloads import VOCAB, prompt_with_prefix


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sequences", type=int, default=10_000, help="sequences (default 10,000)")
    p.add_argument("--prompt-len", type=int, default=200, help="prompt tokens per sequence (default 200)")
    p.add_argument("--shared-prefix", type=int, default=128, help="leading prompt tokens all sequences share (default 128)")
    p.add_argument("--decode-rounds", type=int, default=64, help="tokens appended per sequence (default 64)")
    p.add_argument("--block-size", type=int, default=16, help="block size (default 16)")
    p.add_argument("--seed", type=int, default=0, help="random seed")


def _run_once(args: argparse.Namespace, prefix_caching: bool) -> dict:
    rng = random.Random(args.seed)
    B = args.block_size
    per_seq = blocks_for(args.prompt_len + args.decode_rounds, B) + 1
    pool = BlockPool(
        PoolConfig(
            num_blocks=args.sequences * per_seq,
            block_size=B,
            enable_prefix_caching=prefix_caching,
            model_fingerprint="bench",
        )
    )
    shared = [rng.randrange(VOCAB) for _ in range(args.shared_prefix)]
    prompts = [prompt_with_prefix(rng, shared, args.prompt_len) for _ in range(args.sequences)]
    ids = [f"seq-{i}" for i in range(args.sequences)]
    decode_tokens = [[rng.randrange(VOCAB)] for _ in range(args.decode_rounds)]

    t0 = time.perf_counter()
    for sid, prompt in zip(ids, prompts, strict=True):
        pool.admit(sid, prompt)
    t1 = time.perf_counter()
    append = pool.append
    for tok in decode_tokens:
        for sid in ids:
            append(sid, tok)
    t2 = time.perf_counter()
    for sid in ids:
        pool.free(sid)
    t3 = time.perf_counter()
    assert pool.check_integrity()
    n, appends = args.sequences, args.sequences * args.decode_rounds
    s = pool.stats()
    return {
        "prefix_caching": prefix_caching,
        "admit_us": (t1 - t0) / n * 1e6,
        "append_us": (t2 - t1) / appends * 1e6,
        "free_us": (t3 - t2) / n * 1e6,
        "admits_per_s": n / (t1 - t0),
        "appends_per_s": appends / (t2 - t1),
        "frees_per_s": n / (t3 - t2),
        "prefix_hit_rate": s.prefix_hit_rate,
    }


def run(args: argparse.Namespace) -> int:
    if args.sequences < 1 or args.prompt_len < 1 or args.decode_rounds < 1 or args.block_size < 1:
        from pagedkv_base.settings import CliError

        raise CliError("--sequences, --prompt-len, --decode-rounds and --block-size must be positive")
    args.shared_prefix = min(args.shared_prefix, args.prompt_len)
    results = [_run_once(args, False), _run_once(args, True)]
    out = {
        "sequences": args.sequences,
        "prompt_len": args.prompt_len,
        "decode_rounds": args.decode_rounds,
        "block_size": args.block_size,
        "results": results,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"allocator core, {args.sequences:,} sequences, block size {args.block_size}")
    for col in ("prefix caching", "admit (us)", "append (us)", "free (us)", "appends/s", "hit rate"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(
            "on" if r["prefix_caching"] else "off", f"{r['admit_us']:.2f}", f"{r['append_us']:.3f}",
            f"{r['free_us']:.2f}", f"{r['appends_per_s']:,.0f}", f"{r['prefix_hit_rate']:.1%}",
        )
    Console(width=120).print(t)
    return 0
