"""`pagedkv bench allocator`: Step latency and operations per second of the
allocator in-process, over gRPC, and over gRPC with the Redis journal
(`--modes`), for 1, 64 and 256 sequences per step (`workloads.STEPS`), in one
run.

`--watch-events none,plain,packed` times the gRPC steps again while another
process follows every KV event of the server as a router with a cache view
does (a snapshot, then `plain`: one message per block event; `packed`: a
record's run of block events in one message, what the router asks for),
interleaved with
the unwatched case: what a router's event stream costs the pools' Steps.

The workload is a decode loop: every running sequence appends one token per
step; each step a few sequences finish (free) and as many new ones arrive
(admit, 128-token prompts sharing a 64-token system prompt), with prefix
caching on and 16-token blocks, as a vLLM-style worker would run. Latency is
measured where the worker sees it: around `AllocatorClient.step`, request
encoding and result decoding included. The servers are separate processes
(`python -m allocator_service`), the Redis a private `redis-server` with
append-only persistence.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

from allocator_service.core import PoolConfig, blocks_for
from pagedkv.bench import harness, noisy_neighbour
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.systems.allocators import WATCHERS, EventFollower, connect, deploy
from pagedkv.bench.workloads import MAX_GEN, PROMPT_LEN, STEPS, StepWorkload, decode_steps

MODES = ("in-process", "grpc", "grpc+redis", "grpc-unary", "grpc-unary+redis")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_workload_option(parser, STEPS)
    parser.add_argument(
        "--modes",
        type=harness.comma_list(MODES),
        default=["in-process", "grpc", "grpc+redis"],
        help="which of in-process, grpc, grpc+redis, grpc-unary, grpc-unary+redis to run (grpc: "
        "steps over the StepStream call, as workers send them; grpc-unary: "
        "one unary Step each) [in-process,grpc,grpc+redis]",
    )
    parser.add_argument(
        "--watch-events",
        type=harness.comma_list(WATCHERS),
        default=["none"],
        metavar="LIST",
        help="for the gRPC modes, time each case with each of: none (no watcher), plain (a process "
        "following every KV event, one message each), packed (runs of block events per message, as "
        "the router's cache view asks) [none]",
    )
    harness.add_json_option(parser)
    noisy_neighbour.add_arguments(parser)


def measure_steps(client, num_seqs: int, steps: int, warmup: int) -> dict:
    """The decode loop of `num_seqs` sequences through `client`:
    each Step timed where the worker sees it."""
    gen = decode_steps(num_seqs, seed=num_seqs)
    client.step(next(gen))
    for _ in range(warmup):
        client.step(next(gen))
    times: list[float] = []
    ops_done = 0
    for _ in range(steps):
        ops = next(gen)
        t0 = time.perf_counter()
        results = client.step(ops)
        times.append(time.perf_counter() - t0)
        ops_done += len(ops)
        if not results.all_ok:
            raise RuntimeError(f"benchmark pool too small: {[r for r in results if not r.ok][:1]}")
    return {
        "seqs": num_seqs,
        "steps": steps,
        "ops_per_step": ops_done / steps,
        "p50_ms": 1e3 * harness.percentile(times, 0.5),
        "p99_ms": 1e3 * harness.percentile(times, 0.99),
        "mean_ms": 1e3 * statistics.fmean(times),
        "ops_per_s": ops_done / sum(times),
    }


def measure(args: argparse.Namespace) -> dict:
    w = STEPS[args.workload]
    if args.noisy_neighbour:
        return noisy_neighbour.measure(w, args.separate_neighbour, measure_steps)
    sizes, watchers = w.sizes, args.watch_events
    results = []
    for mode in args.modes:
        with contextlib.ExitStack() as stack:
            kind = "embedded" if mode == "in-process" else mode.replace("-unary", "")
            address = deploy(stack, kind)
            for n in sizes:
                for watcher in watchers if kind != "embedded" else ["none"]:
                    results.append(
                        {"mode": mode, "watcher": watcher, **_case(w, address, mode, watcher, n)}
                    )
    out = {
        "block_size": w.block_size,
        "prefix_caching": w.prefix_caching,
        "cpus": os.cpu_count(),
        "load_average_1m": harness.load_average(),
        "results": results,
    }
    by = {(r["mode"], r["seqs"]): r for r in results if r["watcher"] == "none"}
    for n in sizes:
        if ("grpc", n) in by and ("grpc+redis", n) in by:
            out.setdefault("redis_overhead_p50", {})[str(n)] = (
                by[("grpc+redis", n)]["p50_ms"] / by[("grpc", n)]["p50_ms"] - 1
            )
    return out


def _case(w: StepWorkload, address: str, mode: str, watcher: str, n: int) -> dict:
    """One (mode, watcher, sequences) case on a fresh pool."""
    from allocator_service.client import PoolSpec

    blocks_per_seq = blocks_for(PROMPT_LEN + MAX_GEN, w.block_size) + 2
    spec = PoolSpec(
        f"bench-{mode}-{watcher}-{n}",
        PoolConfig(
            num_blocks=n * blocks_per_seq + 64,
            block_size=w.block_size,
            enable_prefix_caching=w.prefix_caching,
            model_fingerprint="bench",
        ),
    )
    client = connect(address, spec, step_stream="unary" not in mode)
    follower = None
    try:
        if watcher != "none":
            follower = EventFollower(address, watcher == "packed")
        row = measure_steps(client, n, w.steps, w.warmup)
        return row | (follower.stop() if follower is not None else {})
    finally:
        if follower is not None:
            follower.stop()
        client.close()


def tables(report: dict) -> list[Table]:
    if report.get("benchmark") == "noisy-neighbour":
        return noisy_neighbour.tables(report)
    results = report["results"]
    watched = any(r["watcher"] != "none" for r in results)
    columns = ["mode", "seqs", "ops/step", "p50 ms", "p99 ms", "ops/s"]
    if watched:
        columns += ["watcher", "messages", "events"]
    rows = []
    for r in results:
        row = [
            r["mode"],
            cell(r["seqs"]),
            cell(r["ops_per_step"], ".1f"),
            cell(r["p50_ms"], ".3f"),
            cell(r["p99_ms"], ".3f"),
            cell(r["ops_per_s"], ",.0f"),
        ]
        if watched:
            row += [
                r["watcher"],
                cell(r.get("watcher_messages"), ","),
                cell(r.get("watcher_events"), ","),
            ]
        rows.append(row)
    steps = results[0]["steps"] if results else None
    notes = [
        f"Redis journal adds {100 * v:.0f}% to the p50 at {n} sequences per step"
        for n, v in report.get("redis_overhead_p50", {}).items()
    ]
    return [
        Table(
            title=f"Step latency, block size {report['block_size']}, prefix caching "
            f"{cell(report['prefix_caching'])}, {cell(steps)} steps per case",
            columns=columns,
            rows=rows,
            notes=notes,
        )
    ]


def figures(report: dict) -> dict[str, tuple[float | None, bool]]:
    """The headline figures (`bench compare`): each unwatched
    case's Step p50 and p99, lower is better."""
    out: dict[str, tuple[float | None, bool]] = {}
    for r in report.get("results", []):
        if r.get("watcher", "none") == "none":
            for q in ("p50", "p99"):
                out[f"{r['mode']} {r['seqs']} seqs Step {q} ms"] = (r.get(f"{q}_ms"), True)
    return out


def run(args: argparse.Namespace) -> int:
    return harness.run("allocator", args, measure, tables)
