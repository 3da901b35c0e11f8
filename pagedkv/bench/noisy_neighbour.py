"""`pagedkv bench allocator --noisy-neighbour`: does one pool's work delay another's?

A victim pool runs the decode loop of `pagedkv bench allocator` (64 sequences
by default) against a real allocator process, first alone, then while a second
pool, driven from another process, sends the heaviest requests the allocator
accepts from a legitimate worker: whole-context admits, forks of long
sequences, integrity checks, full dumps, and MatchPrefix calls with a long
prompt. The figure is the victim's Step latency in both phases; the target is
a p99 with the neighbour at most twice the quiet p99.

The neighbour is a separate process so that it competes with the victim only
inside the allocator (its lock, its CPU), not in the benchmark's own
interpreter.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import time
from collections import Counter

from allocator_service.core import Admit, Fork, Free, PoolConfig, blocks_for
from pagedkv.bench.workloads import MAX_GEN, PROMPT_LEN, prompt_with_prefix


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--noisy-neighbour", action="store_true",
        help="measure a victim pool's Step latency alone and while another pool sends the heaviest "
             "legal requests (admits, forks, integrity checks, dumps, MatchPrefix)",
    )
    parser.add_argument("--victim-seqs", type=int, default=64,
                        help="with --noisy-neighbour: sequences per victim step [%(default)s]")
    parser.add_argument("--neighbour-blocks", type=int, default=65536,
                        help="with --noisy-neighbour: blocks in the neighbour's pool [%(default)s]")
    parser.add_argument("--neighbour-prompt", type=int, default=32768,
                        help="with --noisy-neighbour: tokens in each of the neighbour's admits [%(default)s]")
    parser.add_argument("--separate-neighbour", action="store_true",
                        help="with --noisy-neighbour: the neighbour's pool on an allocator process of its own "
                             "(the best that pools sharded across processes could give)")


def _neighbour(address: str, block_size: int, num_blocks: int, prompt_len: int,
               stop: mp.synchronize.Event, ready: mp.synchronize.Event, counts: dict) -> None:
    """The noisy pool's loop (runs in its own process until `stop`)."""
    import grpc

    from allocator_service.client import PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator, RouterClient

    spec = PoolSpec("noisy-neighbour", PoolConfig(num_blocks, block_size, True, "bench"))
    client = GrpcAllocator(address, spec, deadline_s=60.0)
    router = RouterClient(address, deadline_s=60.0)
    rng = random.Random(1)
    done: Counter[str] = Counter()
    round_ = 0

    def call(kind: str, fn, *args) -> None:
        try:
            fn(*args)
            done[kind] += 1
        except grpc.RpcError as err:  # refused is an answer too: count it
            done[f"{kind} refused ({err.code().name})"] += 1

    try:
        while not stop.is_set():
            round_ += 1
            prompt = prompt_with_prefix(rng, [], prompt_len)
            parent = f"p{round_}"
            call("admit", client.step, [Admit(parent, prompt)])
            ready.set()
            call("fork x8", client.step, [Fork(parent, f"{parent}-c{i}") for i in range(8)])
            call("integrity check", client.integrity_problems)
            call("dump", client.dump)
            call("match prefix", router.match_prefix, "bench", prompt)
            call("free", client.step, [Free(parent), *(Free(f"{parent}-c{i}") for i in range(8))])
            counts.update(done)
    finally:
        ready.set()
        counts.update(done)
        client.close()
        router.close()


def run(args: argparse.Namespace, measure) -> dict:
    """Both phases against one allocator process; `measure(client, n, steps,
    warmup)` is the decode-loop timer of `pagedkv bench allocator`."""
    from allocator_service.client import PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator
    from pagedkv.stack import start_allocator

    n = args.victim_seqs
    blocks_per_seq = blocks_for(PROMPT_LEN + MAX_GEN, args.block_size) + 2
    victim_config = PoolConfig(n * blocks_per_seq + 64, args.block_size, True, "bench")

    def victim_steps(name: str) -> dict:
        """A fresh victim pool (the decode loop starts from its first admit), timed."""
        victim = GrpcAllocator(server.address, PoolSpec(name, victim_config))
        try:
            return measure(victim, n, args.steps, args.warmup)
        finally:
            victim.close()

    ctx = mp.get_context("spawn")
    server = start_allocator(["--lease-ttl", "30"])
    own = start_allocator(["--lease-ttl", "30"]) if args.separate_neighbour else None
    try:
        quiet = victim_steps("victim-alone")
        with ctx.Manager() as manager:
            counts = manager.dict()
            stop, ready = ctx.Event(), ctx.Event()
            proc = ctx.Process(
                target=_neighbour,
                args=((own or server).address, args.block_size, args.neighbour_blocks, args.neighbour_prompt,
                      stop, ready, counts),
                daemon=True,
            )
            proc.start()
            ready.wait(120)
            t0 = time.perf_counter()
            noisy = victim_steps("victim-with-neighbour")
            seconds = time.perf_counter() - t0
            stop.set()
            proc.join(120)
            neighbour = dict(sorted(counts.items()))
    finally:
        server.terminate()
        if own is not None:
            own.terminate()
    return {
        "benchmark": "noisy-neighbour",
        "block_size": args.block_size,
        "victim_seqs": n,
        "neighbour_blocks": args.neighbour_blocks,
        "neighbour_prompt_tokens": args.neighbour_prompt,
        "neighbour_allocator": "own" if own is not None else "shared",
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "quiet": quiet,
        "noisy": noisy,
        "noisy_seconds": round(seconds, 2),
        "neighbour_requests": neighbour,
        "p50_ratio": noisy["p50_ms"] / quiet["p50_ms"],
        "p99_ratio": noisy["p99_ms"] / quiet["p99_ms"],
        "target_p99_ratio": 2.0,
    }


def print_table(out: dict) -> None:
    print(f"Victim pool: {out['victim_seqs']} sequences per step, block size {out['block_size']}; "
          f"neighbour: {out['neighbour_blocks']:,} blocks, {out['neighbour_prompt_tokens']:,}-token admits "
          f"({out['neighbour_allocator']} allocator process); "
          f"{out['cpus']} CPUs, load average {out['load_average_1m']}")
    print(f"{'victim step latency':<28} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}")
    for name in ("quiet", "noisy"):
        r = out[name]
        label = "alone" if name == "quiet" else "with the noisy neighbour"
        print(f"{label:<28} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} {r['mean_ms']:>9.3f}")
    print(f"p99 with the neighbour / alone: {out['p99_ratio']:.1f}x (target at most "
          f"{out['target_p99_ratio']:.0f}x); p50: {out['p50_ratio']:.1f}x")
    done = ", ".join(f"{k} {v}" for k, v in out["neighbour_requests"].items())
    print(f"neighbour requests in {out['noisy_seconds']} s: {done}")
