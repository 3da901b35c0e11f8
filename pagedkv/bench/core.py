"""`pagedkv bench core`: operations per second of the allocator core.

The sequences of the workload (`workloads.CORE`: 10,000 by default) are
admitted with a prompt, decoded for a number of rounds (one token appended
per sequence per round, the hot path of a serving step) and freed, with
prefix caching off and on. With caching on, every prompt starts with the same
system prompt, so admits hit the cache.
"""

from __future__ import annotations

import argparse
import random
import time

from allocator_service.core import BlockPool, PoolConfig, blocks_for
from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.workloads import CORE, VOCAB, CoreWorkload, prompt_with_prefix


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_workload_option(p, CORE)
    harness.add_json_option(p)


def _run_once(w: CoreWorkload, prefix_caching: bool) -> dict:
    rng = random.Random(w.seed)
    B = w.block_size
    per_seq = blocks_for(w.prompt_len + w.decode_rounds, B) + 1
    pool = BlockPool(
        PoolConfig(
            num_blocks=w.sequences * per_seq,
            block_size=B,
            enable_prefix_caching=prefix_caching,
            model_fingerprint="bench",
        )
    )
    shared = [rng.randrange(VOCAB) for _ in range(w.shared_prefix)]
    prompts = [prompt_with_prefix(rng, shared, w.prompt_len) for _ in range(w.sequences)]
    ids = [f"seq-{i}" for i in range(w.sequences)]
    decode_tokens = [[rng.randrange(VOCAB)] for _ in range(w.decode_rounds)]

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
    n, appends = w.sequences, w.sequences * w.decode_rounds
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
    w = CORE[args.workload]
    return {
        "sequences": w.sequences,
        "prompt_len": w.prompt_len,
        "shared_prefix": w.shared_prefix,
        "decode_rounds": w.decode_rounds,
        "block_size": w.block_size,
        "results": [_run_once(w, False), _run_once(w, True)],
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


def figures(report: dict) -> dict[str, tuple[float | None, bool]]:
    """The headline figures (`bench compare`): each operation's time, prefix caching off and on,
    lower is better."""
    out: dict[str, tuple[float | None, bool]] = {}
    for r in report.get("results", []):
        caching = "on" if r["prefix_caching"] else "off"
        for op in ("admit", "append", "free"):
            out[f"prefix caching {caching}: {op} us"] = (r.get(f"{op}_us"), True)
    return out


def run(args: argparse.Namespace) -> int:
    return harness.run("core", args, measure, tables)
