"""`pagedkv bench core`: operations per second of the allocator core.

10,000 sequences (by default) are admitted with a prompt, decoded for a number
of rounds (one token appended per sequence per round, the hot path of a
serving step) and freed, with prefix caching off and on. With caching on,
every prompt starts with the same system prompt, so admits hit the cache.
"""

from __future__ import annotations

import argparse
import random
import time

from allocator_service.core import BlockPool, PoolConfig, blocks_for
from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.workloads import VOCAB, prompt_with_prefix


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sequences", type=harness.positive, default=10_000, help="sequences (default 10,000)")
    p.add_argument("--prompt-len", type=harness.positive, default=200, help="prompt tokens per sequence (default 200)")
    p.add_argument("--shared-prefix", type=int, default=128, help="leading prompt tokens all sequences share (default 128)")
    p.add_argument("--decode-rounds", type=harness.positive, default=64, help="tokens appended per sequence (default 64)")
    p.add_argument("--block-size", type=harness.positive, default=16, help="block size (default 16)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    harness.add_json_option(p)


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


def measure(args: argparse.Namespace) -> dict:
    args.shared_prefix = min(args.shared_prefix, args.prompt_len)
    return {
        "sequences": args.sequences,
        "prompt_len": args.prompt_len,
        "shared_prefix": args.shared_prefix,
        "decode_rounds": args.decode_rounds,
        "block_size": args.block_size,
        "results": [_run_once(args, False), _run_once(args, True)],
    }


def tables(report: dict) -> list[Table]:
    rows = [[cell(r["prefix_caching"]), cell(r["admit_us"], ".2f"), cell(r["append_us"], ".3f"),
             cell(r["free_us"], ".2f"), cell(r["appends_per_s"], ",.0f"), cell(r["prefix_hit_rate"], ".1%")]
            for r in report["results"]]
    return [Table(
        title=f"allocator core, {report['sequences']:,} sequences of {report['prompt_len']} prompt tokens "
              f"({report.get('shared_prefix', '-')} shared), {report['decode_rounds']} decode rounds, "
              f"block size {report['block_size']}",
        columns=["prefix caching", "admit (us)", "append (us)", "free (us)", "appends/s", "hit rate"],
        rows=rows)]


def run(args: argparse.Namespace) -> int:
    return harness.run("core", args, measure, tables)
