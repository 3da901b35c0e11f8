"""`pagedkv bench allocator --noisy-neighbour`: does one pool's work delay another's?

A victim pool runs the decode loop of `pagedkv bench allocator` (64 sequences
in the default workload) against a real allocator process, first alone, then while a second
pool, driven from another process, sends the heaviest requests the allocator
accepts from a legitimate worker: whole-context admits, forks of long
sequences, integrity checks, full dumps, and MatchPrefix calls with a long
prompt. The figure is the victim's Step latency in both phases; the target is
a p99 with the neighbour at most twice the quiet p99. Beside it, the same
steps as the allocator timed them inside its handler (its own
`rpc_duration_seconds` histogram, read from its /metrics before and after
each phase; bucket upper bounds): what the rest took is the way in and out
through gRPC's threads, which share the interpreter with the neighbour's work.

The neighbour is a separate process so that it competes with the victim only
inside the allocator (its lock, its CPU), not in the benchmark's own
interpreter; its requests are serialized before timing starts and its answers
are not parsed (`_Prebuilt`), so that on a small machine its own client takes
as little of the victims' CPUs as it can. With `--separate-neighbour` its pool
is on an allocator process of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial

from allocator_service.core import Admit, Fork, Free, PoolConfig, blocks_for
from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.workloads import MAX_GEN, PROMPT_LEN, StepWorkload, prompt_with_prefix


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--noisy-neighbour",
        action="store_true",
        help="measure a victim pool's Step latency alone and while another pool sends the heaviest "
        "legal requests (admits, forks, integrity checks, dumps, MatchPrefix)",
    )
    parser.add_argument(
        "--separate-neighbour",
        action="store_true",
        help="with --noisy-neighbour: the neighbour's pool on an allocator process of its own "
        "(pools sharded across allocator processes, as `pagedkv up --allocators 2` runs "
        "them)",
    )


# Distinct prompts the prebuilt neighbour cycles through: more than its pool
# keeps cached (65,536 blocks of 16 hold 32 prompts of 32k tokens), so every
# admit misses the cache, as a fresh prompt does.
_ROUNDS = 40


class _Prebuilt:
    """The neighbour's client at the least CPU it can cost: every request
    serialized before timing starts, no answer parsed.

    A worker that sends heavy requests runs on its own host. Here its client
    shares the benchmark machine's CPUs with the victim and the allocator;
    building 32k-token requests and parsing 65,536-block dumps as it goes
    (as a worker's `GrpcAllocator` does) takes a CPU the victim then waits for, which is the
    benchmark's doing, not the allocator's. A Step request is its step-less
    part (pool and operations) followed by the step id as a second
    serialized message (protobuf merges concatenated messages): the id is
    the only field that changes when a round is sent again."""

    def __init__(self, address: str, config: PoolConfig, prompt_len: int) -> None:
        import grpc

        from allocator_service.rpc.servicer import SERVICE_NAME
        from allocator_service.wire.codec import encode_ops, shape_to_proto
        from allocator_service.wire.v1 import allocator_pb2 as pb

        self._pb = pb
        self._channel = grpc.insecure_channel(
            address,
            options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
        )
        # bytes in, bytes out: with no serializers, no answer is parsed
        self._method = {
            name: self._channel.unary_unary(f"/{SERVICE_NAME}/{name}")
            for name in ("RegisterPool", "Step", "GetPoolStats", "DumpPool", "MatchPrefix")
        }
        register = pb.RegisterPoolRequest(worker_id="noisy-neighbour", shape=shape_to_proto(config))
        answer = pb.RegisterPoolResponse.FromString(
            self._method["RegisterPool"](register.SerializeToString(), timeout=60)
        )
        ref = pb.PoolRef(pool_id=answer.pool_id, credential=answer.credential)

        def step(ops) -> bytes:
            return pb.StepRequest(pool=ref, ops=encode_ops(ops)).SerializeToString()

        rng = random.Random(1)
        self._rounds = []
        for i in range(_ROUNDS):
            prompt, parent = prompt_with_prefix(rng, [], prompt_len), f"p{i}"
            children = [f"{parent}-c{c}" for c in range(8)]
            self._rounds.append(
                [
                    ("admit", "Step", step([Admit(parent, prompt)])),
                    ("fork x8", "Step", step([Fork(parent, c) for c in children])),
                    (
                        "integrity check",
                        "GetPoolStats",
                        pb.GetPoolStatsRequest(pool=ref, check_integrity=True).SerializeToString(),
                    ),
                    ("dump", "DumpPool", pb.DumpPoolRequest(pool=ref).SerializeToString()),
                    (
                        "match prefix",
                        "MatchPrefix",
                        pb.MatchPrefixRequest(
                            model_fingerprint=config.model_fingerprint, tokens=prompt
                        ).SerializeToString(),
                    ),
                    ("free", "Step", step([Free(parent), *(Free(c) for c in children)])),
                ]
            )
        self._step_id = 0

    def _send(self, name: str, request: bytes) -> None:
        if name == "Step":
            self._step_id += 1
            request += self._pb.StepRequest(step_id=self._step_id).SerializeToString()
        self._method[name](request, timeout=60)

    def round(self, i: int) -> list[tuple[str, Callable[[], object]]]:
        return [
            (kind, partial(self._send, name, request))
            for kind, name, request in self._rounds[i % _ROUNDS]
        ]

    def close(self) -> None:
        self._channel.close()


def _neighbour(
    address: str,
    block_size: int,
    num_blocks: int,
    prompt_len: int,
    stop: mp.synchronize.Event,
    ready: mp.synchronize.Event,
    counts: dict,
) -> None:
    """The noisy pool's loop (runs in its own process until `stop`): rounds
    of the heaviest legal calls, `ready` once the first admit is answered."""
    import grpc

    config = PoolConfig(num_blocks, block_size, True, "bench")
    client = _Prebuilt(address, config, prompt_len)
    done: Counter[str] = Counter()
    try:
        i = 0
        while not stop.is_set():
            for kind, call in client.round(i):
                try:
                    call()
                    done[kind] += 1
                except grpc.RpcError as err:  # refused is an answer too: count it
                    done[f"{kind} refused ({err.code().name})"] += 1
                ready.set()
            i += 1
            counts.update(done)
    finally:
        ready.set()
        counts.update(done)
        client.close()


def _server_step_buckets(metrics_url: str) -> dict[float, float]:
    """The allocator's own histogram of the step messages it answered
    (`rpc_duration_seconds`, StepStream, OK): cumulative count by upper
    bound in seconds. Only the victim streams its steps (the neighbour sends
    unary calls), so the difference over a phase is the
    victim's: its timed steps and its few warm-up steps."""
    return {
        float(sample.labels["le"]): sample.value
        for sample in harness.metric_samples(metrics_url)
        if sample.name.endswith("rpc_duration_seconds_bucket")
        and sample.labels.get("method") == "StepStream"
        and sample.labels.get("code") == "OK"
    }


def _bucket_quantiles(
    before: dict[float, float], after: dict[float, float]
) -> dict[str, float | None]:
    """p50 and p99 of the histogram's growth between two readings, each as
    the upper bound of its bucket in ms (None: no step answered)."""
    grown = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = grown[-1][1] if grown else 0.0
    out: dict[str, float | None] = {}
    for name, q in (("server_p50_le_ms", 0.5), ("server_p99_le_ms", 0.99)):
        le = next((le for le, count in grown if total and count >= q * total), None)
        out[name] = None if le is None else (math.inf if math.isinf(le) else le * 1000)
    return out


@contextlib.contextmanager
def _running_neighbour(address: str, w: StepWorkload) -> Iterator[dict[str, int]]:
    """The neighbour's process, sending from its first answered admit until
    the block exits; then the requests it sent, by kind (filled in on exit)."""
    ctx = mp.get_context("spawn")
    sent: dict[str, int] = {}
    with ctx.Manager() as manager:
        counts = manager.dict()
        stop, ready = ctx.Event(), ctx.Event()
        proc = ctx.Process(
            target=_neighbour,
            args=(
                address,
                w.block_size,
                w.neighbour_blocks,
                w.neighbour_prompt,
                stop,
                ready,
                counts,
            ),
            daemon=True,
        )
        proc.start()
        try:
            ready.wait(120)
            yield sent
        finally:
            stop.set()
            proc.join(120)
            sent.update(counts.items())


def measure(w: StepWorkload, separate: bool, measure_steps) -> dict:
    """Both phases against one allocator process (the neighbour on its own with
    `separate`); `measure_steps(client, n, steps, warmup)` is the decode-loop
    timer of `pagedkv bench allocator`."""
    from allocator_service.client import PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator
    from pagedkv.stack import start_allocator

    n = w.victim_seqs
    blocks_per_seq = blocks_for(PROMPT_LEN + MAX_GEN, w.block_size) + 2
    victim_config = PoolConfig(n * blocks_per_seq + 64, w.block_size, True, "bench")

    def victim_steps(name: str) -> dict:
        """A fresh victim pool (the decode loop starts from its first admit),
        timed by its client and, inside its handler, by the allocator."""
        victim = GrpcAllocator(server.address, PoolSpec(name, victim_config))
        before = _server_step_buckets(server.metrics_url)
        try:
            timed = measure_steps(victim, n, w.steps, w.warmup)
        finally:
            victim.close()
        return {**timed, **_bucket_quantiles(before, _server_step_buckets(server.metrics_url))}

    server = start_allocator(["--metrics-port", "0"])
    own = start_allocator() if separate else None
    try:
        quiet = victim_steps("victim-alone")
        with _running_neighbour((own or server).address, w) as neighbour:
            t0 = time.perf_counter()
            noisy = victim_steps("victim-with-neighbour")
            seconds = time.perf_counter() - t0
    finally:
        server.terminate()
        if own is not None:
            own.terminate()
    return {
        "benchmark": "noisy-neighbour",
        "block_size": w.block_size,
        "victim_seqs": n,
        "neighbour_blocks": w.neighbour_blocks,
        "neighbour_prompt_tokens": w.neighbour_prompt,
        "neighbour_allocator": "own" if own is not None else "shared",
        "neighbour_client": "prebuilt",
        "cpus": os.cpu_count(),
        "load_average_1m": harness.load_average(),
        "quiet": quiet,
        "noisy": noisy,
        "noisy_seconds": round(seconds, 2),
        "neighbour_requests": dict(sorted(neighbour.items())),
        "p50_ratio": noisy["p50_ms"] / quiet["p50_ms"],
        "p99_ratio": noisy["p99_ms"] / quiet["p99_ms"],
        "target_p99_ratio": 2.0,
    }


def tables(out: dict) -> list[Table]:
    rows = []
    for name, label in (("quiet", "alone"), ("noisy", "with the noisy neighbour")):
        r = out[name]
        rows.append(
            [
                label,
                cell(r["p50_ms"], ".3f"),
                cell(r["p99_ms"], ".3f"),
                cell(r["mean_ms"], ".3f"),
                f"<= {cell(r['server_p50_le_ms'], 'g')}",
                f"<= {cell(r['server_p99_le_ms'], 'g')}",
            ]
        )
    done = ", ".join(f"{k} {v}" for k, v in out["neighbour_requests"].items())
    return [
        Table(
            title=f"Victim pool: {out['victim_seqs']} sequences per step, block size "
            f"{out['block_size']}; neighbour: {out['neighbour_blocks']:,} blocks, "
            f"{out['neighbour_prompt_tokens']:,}-token admits ({out['neighbour_allocator']} "
            f"allocator process, {out['neighbour_client']} client)",
            columns=[
                "victim step latency",
                "p50 ms",
                "p99 ms",
                "mean ms",
                "in the handler: p50 ms",
                "p99 ms",
            ],
            rows=rows,
            notes=[
                f"p99 with the neighbour / alone: {out['p99_ratio']:.1f}x (target at most "
                f"{out['target_p99_ratio']:.0f}x); p50: {out['p50_ratio']:.1f}x",
                f"neighbour requests in {out['noisy_seconds']} s: {done}",
            ],
        )
    ]
