"""`pagedkv bench core`: operations per second of the allocator core.

The sequences of the workload (`workloads.CORE`: 10,000 by default) are
admitted with a prompt, decoded for a number of rounds (one token appended
per sequence per round, the hot path of a serving step) and freed, with
prefix caching off and on. With caching on, every prompt starts with the same
system prompt, so admits hit the cache.

`--against vllm` also runs the decode steps of `bench allocator`
(`workloads.decode_steps`: 256 running sequences, each appending one token a
step, a few finishing and as many arriving) through this core's `run_step`
and through vLLM's `KVCacheManager` (`systems/vllm_kv.py`, run by
`--vllm-python`, an interpreter where vLLM is installed), in three rounds that
alternate the two, and reports the CPU time per step of each side by side: each
figure the median of the rounds', the ratio the median of each round's own
ratio (the machine's speed drifts between rounds). Without vLLM that comparison is skipped
and says why.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from allocator_service.core import BlockPool, PoolConfig, blocks_for
from allocator_service.core.run import run_step, step_columns
from allocator_service.core.step import Append, Free
from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.workloads import (
    CORE,
    MAX_GEN,
    PROMPT_LEN,
    VOCAB,
    CoreWorkload,
    decode_steps,
    prompt_with_prefix,
)

AGAINST = ("vllm",)
DECODE_SEQS = 256  # running sequences of the side-by-side decode steps
DECODE_STEPS, DECODE_WARMUP = 400, 50
# Alternating rounds of the two sides (`_against`).
ROUNDS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_workload_option(p, CORE)
    p.add_argument(
        "--against",
        choices=AGAINST,
        default=None,
        help="also run 256-sequence decode steps through this core and through vLLM's "
        "KVCacheManager in three alternating rounds, CPU time per step side by side",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="the Python interpreter where vLLM is installed [this one]",
    )
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


def _decode_stream(block_size: int) -> tuple[list[list], int]:
    """The side-by-side decode steps (warmup first) and the blocks they need."""
    gen = decode_steps(DECODE_SEQS, seed=DECODE_SEQS)
    steps = [next(gen) for _ in range(1 + DECODE_WARMUP + DECODE_STEPS)]
    return steps, DECODE_SEQS * (blocks_for(PROMPT_LEN + MAX_GEN, block_size) + 2) + 64


def _pagedkv_decode(steps: list[list], num_blocks: int, block_size: int) -> list[float]:
    pool = BlockPool(
        PoolConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=True,
            model_fingerprint="bench",
        )
    )
    clock, cpu = time.process_time, []
    for ops in steps:
        t0 = clock()
        result = run_step(pool, step_columns(ops))
        cpu.append(clock() - t0)
        if any(result.errors):
            raise RuntimeError("the benchmark pool is too small")
    return cpu


def _vllm_decode(steps: list[list], num_blocks: int, block_size: int, python: str) -> dict:
    """vLLM's CPU time per step, or {"skipped": why}."""
    wire = [
        [
            ["free", o.seq]
            if type(o) is Free
            else ["append", o.seq, list(o.tokens)]
            if type(o) is Append
            else ["admit", o.seq, list(o.tokens)]
            for o in ops
        ]
        for ops in steps
    ]
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
    }
    job = json.dumps({"block_size": block_size, "num_blocks": num_blocks, "steps": wire})
    try:
        done = subprocess.run(
            [python, "-m", "pagedkv.bench.systems.vllm_kv"],
            input=job,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except OSError as exc:
        return {"skipped": f"{python}: {exc.strerror}"}
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if "No module named 'vllm'" in last:
            return {
                "skipped": f"vLLM is not installed for {python} "
                "(--vllm-python names one where it is)"
            }
        return {"skipped": f"vLLM's side failed: {last}"}
    return json.loads(done.stdout)


def _against(system: str, python: str, block_size: int) -> dict:
    """The decode steps through this core and through vLLM's manager, in ROUNDS alternating
    rounds (this machine's speed drifts: each round's ratio compares neighbours in time)."""
    steps, num_blocks = _decode_stream(block_size)
    ops = sum(len(s) for s in steps[1 + DECODE_WARMUP :]) / DECODE_STEPS
    out = {
        "system": system,
        "seqs": DECODE_SEQS,
        "steps": DECODE_STEPS,
        "ops_per_step": ops,
        "block_size": block_size,
    }
    rounds = []
    for _ in range(ROUNDS):
        mine = _pagedkv_decode(steps, num_blocks, block_size)[1 + DECODE_WARMUP :]
        theirs = _vllm_decode(steps, num_blocks, block_size, python)
        if "skipped" in theirs:
            return (
                out
                | combine([_figures(mine, None)])
                | {
                    "skipped": theirs["skipped"],
                    "version": None,
                }
            )
        rounds.append(_figures(mine, theirs["step_cpu_s"][1 + DECODE_WARMUP :]))
        out["version"] = theirs["vllm"]
    return out | combine(rounds)


def _figures(mine: list[float], theirs: list[float] | None) -> dict:
    """One round's CPU ms per step, p50 and mean, of each side and their ratios (None where
    vLLM did not run)."""
    r: dict = {
        "pagedkv_step_ms_p50": 1e3 * statistics.median(mine),
        "pagedkv_step_ms_mean": 1e3 * statistics.fmean(mine),
        "vllm_step_ms_p50": None,
        "vllm_step_ms_mean": None,
        "ratio_p50": None,
        "ratio_mean": None,
    }
    if theirs is not None:
        r["vllm_step_ms_p50"] = 1e3 * statistics.median(theirs)
        r["vllm_step_ms_mean"] = 1e3 * statistics.fmean(theirs)
        r["ratio_p50"] = r["pagedkv_step_ms_p50"] / r["vllm_step_ms_p50"]
        r["ratio_mean"] = r["pagedkv_step_ms_mean"] / r["vllm_step_ms_mean"]
    return r


def combine(rounds: list[dict]) -> dict:
    """The figures of the comparison: each one the median over `rounds` (`_figures`), the
    ratios the median of each round's own ratio, and the rounds themselves."""
    out: dict = {"rounds": rounds}
    for key in rounds[0]:
        values = [r[key] for r in rounds if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    return out


def measure(args: argparse.Namespace) -> dict:
    w = CORE[args.workload]
    python = args.vllm_python or sys.executable
    against = [_against(args.against, python, w.block_size)] if args.against else []
    return {
        "sequences": w.sequences,
        "prompt_len": w.prompt_len,
        "shared_prefix": w.shared_prefix,
        "decode_rounds": w.decode_rounds,
        "block_size": w.block_size,
        "results": [_run_once(w, False), _run_once(w, True)],
        "against": against,
    }


def tables(report: dict) -> list[Table]:
    rows = [
        [
            cell(r["prefix_caching"]),
            cell(r["admit_us"], ".2f"),
            cell(r["append_us"], ".3f"),
            cell(r["free_us"], ".2f"),
            cell(r["appends_per_s"], ",.0f"),
            cell(r["prefix_hit_rate"], ".1%"),
        ]
        for r in report["results"]
    ]
    return [
        Table(
            title=f"allocator core, {report['sequences']:,} sequences of {report['prompt_len']} "
            f"prompt tokens ({report.get('shared_prefix', '-')} shared), {report['decode_rounds']} "
            f"decode rounds, block size {report['block_size']}",
            columns=[
                "prefix caching",
                "admit (us)",
                "append (us)",
                "free (us)",
                "appends/s",
                "hit rate",
            ],
            rows=rows,
        )
    ] + [_against_table(a) for a in report.get("against", [])]


def _against_table(a: dict) -> Table:
    vllm = f"vLLM {a['version']}" if a.get("version") else "vLLM"
    rows = [
        [
            "PagedKV run_step",
            cell(a["pagedkv_step_ms_p50"], ".3f"),
            cell(a["pagedkv_step_ms_mean"], ".3f"),
        ],
        [
            f"{vllm} KVCacheManager",
            cell(a.get("vllm_step_ms_p50"), ".3f"),
            cell(a.get("vllm_step_ms_mean"), ".3f"),
        ],
    ]
    notes = (
        [f"vLLM skipped: {a['skipped']}"]
        if a.get("skipped")
        else [
            f"PagedKV takes {a['ratio_p50']:.2f}x vLLM's CPU time per step (p50; the median of "
            f"{len(a['rounds'])} alternating rounds: {_ratios(a['rounds'])})"
        ]
    )
    return Table(
        title=f"one decode step of {a['seqs']} sequences ({a['ops_per_step']:.0f} operations: "
        f"appends, a few frees and admits), block size {a['block_size']}, prefix caching on, "
        f"CPU ms per step over {a['steps']} steps",
        columns=["system", "p50 ms", "mean ms"],
        rows=rows,
        notes=notes,
    )


def _ratios(rounds: list[dict]) -> str:
    return ", ".join(f"{r['ratio_p50']:.2f}x" for r in rounds)


def figures(report: dict) -> dict[str, tuple[float | None, bool]]:
    """The headline figures (`bench compare`): each operation's time, prefix caching off and on,
    lower is better."""
    out: dict[str, tuple[float | None, bool]] = {}
    for r in report.get("results", []):
        caching = "on" if r["prefix_caching"] else "off"
        for op in ("admit", "append", "free"):
            out[f"prefix caching {caching}: {op} us"] = (r.get(f"{op}_us"), True)
    for a in report.get("against", []):
        out[f"{a['seqs']}-sequence decode step ms"] = (a.get("pagedkv_step_ms_p50"), True)
    return out


def run(args: argparse.Namespace) -> int:
    return harness.run("core", args, measure, tables)
