"""`pagedkv bench allocator`: Step latency and operations per second of the
allocator in-process, over gRPC, and over gRPC with the Redis journal, for
1, 64 and 256 sequences per step, in one run.

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
append-only persistence (or --redis URL).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from allocator_service.core import PoolConfig, blocks_for
from pagedkv.bench import noisy_neighbour
from pagedkv.bench.workloads import MAX_GEN, PROMPT_LEN, decode_steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1,64,256", help="sequences per step, comma-separated [%(default)s]")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per case [%(default)s]")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps first [%(default)s]")
    parser.add_argument("--block-size", type=int, default=16, help="[%(default)s]")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    parser.add_argument(
        "--modes", default="in-process,grpc,grpc+redis",
        help="which of in-process, grpc, grpc+redis, grpc-unary, grpc-unary+redis to run (grpc: steps "
             "over the StepStream call, as workers send them; grpc-unary: one unary Step each) [%(default)s]",
    )
    parser.add_argument(
        "--watch-events", default="none", metavar="LIST",
        help="for the gRPC modes, time each case with each of: none (no watcher), plain (a process following "
             "every KV event, one message each), packed (runs of block events per message, as the router's "
             "cache view asks) [%(default)s]",
    )
    parser.add_argument(
        "--redis", default=None, metavar="URL",
        help="journal to this Redis (a redis:// URL) instead of starting a private redis-server",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    noisy_neighbour.add_arguments(parser)


def measure(client, num_seqs: int, steps: int, warmup: int) -> dict:
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
    times.sort()
    return {
        "seqs": num_seqs,
        "steps": steps,
        "ops_per_step": ops_done / steps,
        "p50_ms": 1e3 * times[len(times) // 2],
        "p99_ms": 1e3 * times[min(len(times) - 1, int(len(times) * 0.99))],
        "mean_ms": 1e3 * statistics.fmean(times),
        "ops_per_s": ops_done / sum(times),
    }


def run(args: argparse.Namespace) -> int:
    from allocator_service.client import EmbeddedAllocator, PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator
    from pagedkv.stack import start_allocator, start_redis
    from pagedkv_base.settings import CliError

    if args.noisy_neighbour:
        out = noisy_neighbour.run(args, measure)
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            noisy_neighbour.print_table(out)
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - {"in-process", "grpc", "grpc+redis", "grpc-unary", "grpc-unary+redis"}:
        raise CliError(f"unknown mode(s): {', '.join(sorted(unknown))}")
    watchers = [w.strip() for w in args.watch_events.split(",") if w.strip()]
    if not watchers or (unknown := set(watchers) - set(WATCHERS)):
        raise CliError(f"--watch-events: one or more of {', '.join(WATCHERS)}, got {args.watch_events!r}")
    blocks_per_seq = blocks_for(PROMPT_LEN + MAX_GEN, args.block_size) + 2

    def spec(mode: str, n: int) -> PoolSpec:
        return PoolSpec(
            f"bench-{mode}-{n}",
            PoolConfig(
                num_blocks=n * blocks_per_seq + 64,
                block_size=args.block_size,
                enable_prefix_caching=not args.no_prefix_caching,
                model_fingerprint="bench",
            ),
        )

    results = []
    for mode in modes:
        redis = server = None
        try:
            if mode.endswith("+redis"):
                if args.redis:
                    url = args.redis + ("&" if "?" in args.redis else "?") + f"key_prefix=pagedkv-bench-{time.time_ns()}:"
                else:
                    try:
                        redis = start_redis()
                    except FileNotFoundError:
                        raise CliError("grpc+redis needs redis-server on PATH, or --redis URL") from None
                    url = redis.url
                server = start_allocator(["--state", url, "--snapshot-every", "1000"])
            elif mode != "in-process":
                server = start_allocator()
            for n in sizes:
                for watcher in watchers if server is not None else ["none"]:
                    if server is None:
                        client = EmbeddedAllocator(spec(mode, n))
                    else:
                        client = GrpcAllocator(server.address, spec(f"{mode}-{watcher}", n),
                                               step_stream="unary" not in mode)
                    follower = None
                    try:
                        if watcher != "none":
                            follower = EventFollower(server.address, watcher == "packed")
                        row = {"mode": mode, "watcher": watcher, **measure(client, n, args.steps, args.warmup)}
                        if follower is not None:
                            row |= follower.stop()
                        results.append(row)
                    finally:
                        if follower is not None:
                            follower.stop()
                        client.close()
        finally:
            if server is not None:
                server.terminate()
            if redis is not None:
                redis.stop()

    out = {
        "block_size": args.block_size,
        "prefix_caching": not args.no_prefix_caching,
        "cpus": os.cpu_count(),
        # Other work on the machine inflates every figure: say how busy it was.
        "load_average_1m": round(os.getloadavg()[0], 2),
        "results": results,
    }
    by = {(r["mode"], r["seqs"]): r for r in results if r["watcher"] == "none"}
    for n in sizes:
        if ("grpc", n) in by and ("grpc+redis", n) in by:
            out.setdefault("redis_overhead_p50", {})[str(n)] = (
                by[("grpc+redis", n)]["p50_ms"] / by[("grpc", n)]["p50_ms"] - 1
            )
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"Step latency, block size {args.block_size}, prefix caching "
          f"{'on' if out['prefix_caching'] else 'off'}, {args.steps} steps per case, "
          f"{out['cpus']} CPUs, load average {out['load_average_1m']}")
    watched = any(r["watcher"] != "none" for r in results)
    print(f"{'mode':<16} {'seqs':>5} {'ops/step':>9} {'p50 ms':>8} {'p99 ms':>8} {'ops/s':>10}"
          + (f" {'watcher':>8} {'messages':>9} {'events':>8}" if watched else ""))
    for r in results:
        print(f"{r['mode']:<16} {r['seqs']:>5} {r['ops_per_step']:>9.1f} {r['p50_ms']:>8.3f} "
              f"{r['p99_ms']:>8.3f} {r['ops_per_s']:>10.0f}"
              + (f" {r['watcher']:>8} {r.get('watcher_messages', ''):>9} {r.get('watcher_events', ''):>8}"
                 if watched else ""))
    for n, v in out.get("redis_overhead_p50", {}).items():
        print(f"Redis journal adds {100 * v:.0f}% to the p50 at {n} sequences per step")
    return 0


WATCHERS = ("none", "plain", "packed")


class EventFollower:
    """Another process following every KV event of the allocator at
    `address` (packed or not) while a case runs; `stop()` says how many
    messages and events it received."""

    def __init__(self, address: str, packed: bool) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process with grpc threads
        # No lock: one writer, read after it is stopped (a child killed holding a lock would hang the reader).
        self._counts = ctx.Array("q", 2, lock=False)
        self._ready = ctx.Event()
        self._proc = ctx.Process(target=_follow_events, args=(address, packed, self._counts, self._ready), daemon=True)
        self._proc.start()
        self._result: dict | None = None
        deadline = time.monotonic() + 60
        while not self._ready.wait(0.1):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the event follower did not start (exit code {self._proc.exitcode})")

    def stop(self) -> dict:
        if self._result is None:
            self._proc.terminate()
            self._proc.join(10)
            self._result = {"watcher_messages": self._counts[0], "watcher_events": self._counts[1]}
        return self._result


def _follow_events(address: str, packed: bool, counts, ready) -> None:  # pragma: no cover - a child process
    from allocator_service.client.grpc_client import RouterClient
    from allocator_service.v1 import allocator_pb2 as pb

    # As a router's view follows: a snapshot (whose end says the stream is live), then every event.
    for event in RouterClient(address).watch_events(packed=packed, snapshot=True):
        if event.kind == pb.KV_EVENT_KIND_SNAPSHOT_END:
            ready.set()
            continue
        if ready.is_set():  # counted in place: the parent reads them when it stops this process
            counts[0] += 1
            counts[1] += max(1, len(event.block_ids)) if event.kind == pb.KV_EVENT_KIND_BLOCKS_CHANGED else 1
