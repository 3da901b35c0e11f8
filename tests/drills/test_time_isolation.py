"""Isolation in time, on real processes (docs/reliability.md, "Isolation and bounded cost").

- A victim pool's Steps and heartbeats never wait behind a whole heavy call
  of another pool (a dump or integrity check of a 65,536-block pool) while
  the benchmark's noisy neighbour runs in its own process: the victim's
  slowest Step and heartbeat stay below the heavy pool's slowest call.
- A SIGSTOP'd allocator (stopped past the lease TTL, then continued) does
  not expire pools whose workers kept trying to renew; a silent pool still
  expires a TTL later.
- A snapshot over the configured bound is not written (one logged reason,
  backed off), and the journal keeps replaying to the same state.

Only generous, non-flaky properties are asserted; the figures are printed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import statistics
import threading
import time

import pytest

from allocator_service.client import PoolLost, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import Admit, Append, PoolConfig
from allocator_service.wire.v1 import allocator_pb2 as pb
from pagedkv.bench.attackers import snapshot_amplifier
from pagedkv.bench.noisy_neighbour import _neighbour
from pagedkv.bench.workloads import prompt_with_prefix

pytestmark = pytest.mark.slow


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def test_victim_never_waits_behind_a_whole_neighbour_call(allocator_server):
    with allocator_server() as server:
        ctx = mp.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        counts = ctx.Manager().dict()
        noisy = ctx.Process(
            target=_neighbour,
            args=(server.address, 16, 65536, 32768, stop, ready, counts),
            daemon=True,
        )
        heavy = GrpcAllocator(
            server.address, PoolSpec("heavy", PoolConfig(65536, 16, True, "bench")), deadline_s=60
        )
        victim = GrpcAllocator(
            server.address, PoolSpec("victim", PoolConfig(2048, 16, True, "bench")), heartbeat=False
        )
        try:
            rng = random.Random(7)
            heavy.step([Admit("h", prompt_with_prefix(rng, [], 32768))])
            victim.step([Admit(f"v{i}", [i + 1] * 40) for i in range(32)])
            noisy.start()
            assert ready.wait(120)
            heavy_calls: list[float] = []
            beats: list[float] = []
            done = threading.Event()

            def heavy_loop() -> None:
                while not done.is_set():
                    heavy_calls.append(_timed(heavy.dump))
                    heavy_calls.append(_timed(heavy.integrity_problems))

            def beat() -> None:  # one Heartbeat RPC, as the client's heartbeat thread sends it
                victim._call("Heartbeat", pb.HeartbeatRequest(pool=victim._ref), retry=False)

            def beat_loop() -> None:
                while not done.is_set():
                    beats.append(_timed(beat))
                    time.sleep(0.005)

            threads = [threading.Thread(target=heavy_loop), threading.Thread(target=beat_loop)]
            for t in threads:
                t.start()
            steps = []
            try:
                for n in range(400):
                    ops = [Append(f"v{i}", [n % 1000 + 1]) for i in range(32)]
                    steps.append(_timed(victim.step, ops))
            finally:
                done.set()
                for t in threads:
                    t.join(120)
                stop.set()
                noisy.join(60)
        finally:
            heavy.close()
            victim.close()
    slowest = max(heavy_calls)
    q = statistics.quantiles(steps, n=100)
    print(
        f"\nvictim step: p50 {q[49] * 1e3:.2f} ms, p99 {q[98] * 1e3:.2f} ms, max "
        f"{max(steps) * 1e3:.2f} ms; heartbeat max {max(beats) * 1e3:.2f} ms; heavy pool's calls: "
        f"{len(heavy_calls)}, slowest {slowest * 1e3:.1f} ms; neighbour: {dict(counts)}"
    )
    assert max(steps) < slowest, "a victim Step waited behind a whole call of another pool"
    assert max(beats) < slowest, "a heartbeat waited behind a whole call of another pool"


def test_sigstop_does_not_expire_pools_that_kept_renewing(allocator_server):
    ttl = 2.0
    with allocator_server(env={"PAGEDKV_ALLOCATOR_LEASE_TTL": str(ttl)}) as server:
        alive = GrpcAllocator(
            server.address,
            PoolSpec("alive", PoolConfig(16, 4)),
            retries=50,
            backoff_s=0.1,
            deadline_s=2,
        )
        silent = GrpcAllocator(
            server.address, PoolSpec("silent", PoolConfig(16, 4)), heartbeat=False
        )
        try:
            alive.step([Admit("a", [1, 2, 3])])
            silent.step([Admit("a", [1, 2, 3])])
            os.kill(server.pid, signal.SIGSTOP)
            try:
                time.sleep(ttl * 2.5)
            finally:
                os.kill(server.pid, signal.SIGCONT)
            time.sleep(ttl / 2)
            assert alive.block_table("a") == [0]
            assert alive.pool_id == "alive/1", (
                "the allocator dropped a pool while it was itself stopped"
            )
            time.sleep(ttl * 1.5)  # the silent pool's extended lease runs out now
            with pytest.raises(PoolLost):
                silent.block_table("a")
            assert alive.pool_id == "alive/1"
            assert any("did not run for" in line for line in server.lines)
        finally:
            alive.close()
            silent.close()


def test_a_pool_over_its_snapshot_share_is_dropped_and_the_others_lose_nothing(
    allocator_server, redis_store
):
    """A real server whose snapshots are bounded (1 MB): a legal pool whose
    part of the snapshot is over its share (4,000 forks with 256-character
    ids) is dropped loudly (its worker gets PoolLost), the other pool's calls
    are answered throughout, and after a kill -9 the restart from Redis gives
    that pool back exactly."""
    with redis_store() as (url, _):
        args = ("--state", url)
        env = {"PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "3", "PAGEDKV_ALLOCATOR_MAX_SNAPSHOT_MB": "1"}
        with allocator_server(*args, env=env) as server:
            victim = GrpcAllocator(
                server.address, PoolSpec("victim", PoolConfig(256, 16, True, "m"))
            )
            victim.step([Admit("v", prompt_with_prefix(random.Random(3), [], 200))])
            # 8 steps of 500 forks, ids of 256 characters
            big, _ = snapshot_amplifier(server.address)
            for n in range(10):
                assert victim.step([Append("v", [n + 1])]).all_ok
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                "over the bound" in line for line in server.lines
            ):
                time.sleep(0.05)
            assert any("over the bound" in line for line in server.lines), server.log
            with pytest.raises(PoolLost):
                big.step([Append("x" * 256, [1])])
            before = victim.dump()
            server.kill()
        with allocator_server(*args, env=env, listen=f"127.0.0.1:{server.port}"):
            assert victim.dump() == before  # replayed from Redis: nothing lost
            victim.close()
            big.close()
