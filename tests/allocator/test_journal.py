"""Durable state in a real Redis: kill -9 the server between and during
steps, restart it, and find exactly the state (and answers) it had; a Redis
outage is UNAVAILABLE, not a crash."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.router_client import RouterClient
from allocator_service.core import PoolConfig, execute_step
from allocator_service.store.framing import StepRecord, encode_step_record
from allocator_service.wire.codec import canonical_ops, encode_ops, ops_digest
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import journal_pb2 as jpb
from tests.support.allocator import (
    as_json,
    code_of,
    dump,
    random_steps,
    register,
    stub,
)

C = grpc.StatusCode


@pytest.fixture
def store(redis_store):
    with redis_store() as s:
        yield s


def test_kill_between_steps_restores_everything(store, allocator_server):
    url, _ = store
    args = ("--state", url)
    every = {"PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "7"}  # some steps in the snapshot, some replayed
    with allocator_server(*args, env=every) as server:
        s, md, channel = stub(server.address)
        refs = [register(s, md, f"w{i}", num_blocks=24) for i in range(2)]
        workloads = [random_steps(seed=i, steps=30) for i in range(2)]
        answers = {}
        for n in range(30):
            for ref, steps in zip(refs, workloads, strict=True):
                answers[ref.pool_id] = s.Step(
                    pb.StepRequest(pool=ref, step_id=n + 1, ops=encode_ops(steps[n]))
                )
        s.ResetPrefixCache(pb.ResetPrefixCacheRequest(pool=refs[0]))
        gone = register(s, md, "short-lived")
        s.DeregisterPool(pb.DeregisterPoolRequest(pool=gone))
        before = {r.pool_id: dump(s, md, r) for r in refs}
        stats = {r.pool_id: s.GetPoolStats(pb.GetPoolStatsRequest(pool=r)) for r in refs}
        next_event = RouterClient(server.address).watch_events(from_sequence=1, timeout_s=3)
        events_before = []
        for e in next_event:
            events_before.append(e)
            if e.pool_id == gone.pool_id and e.kind == pb.KV_EVENT_KIND_POOL_DROPPED:
                break
        next_event.cancel()
        server.kill()
        channel.close()

    with allocator_server(*args, env=every, listen=f"127.0.0.1:{server.port}") as again:
        assert "2 pools restored" in again.lines[-1]
        s, md, channel = stub(again.address)
        for r in refs:
            assert dump(s, md, r) == before[r.pool_id]
            assert s.GetPoolStats(pb.GetPoolStatsRequest(pool=r)) == stats[r.pool_id]
        # A retry of the last step gets the first answer and is not applied again.
        for r, steps in zip(refs, workloads, strict=True):
            retry = pb.StepRequest(pool=r, step_id=30, ops=encode_ops(steps[29]))
            assert s.Step(retry) == answers[r.pool_id]
            assert dump(s, md, r) == before[r.pool_id]
        assert code_of(s.DumpPool, pb.DumpPoolRequest(pool=gone)) == C.NOT_FOUND
        # Event numbers and epochs carry on where they were.
        fresh = register(s, md, "w0", replace_credential=refs[0].credential)
        stream = RouterClient(again.address).watch_events(
            from_sequence=events_before[-1].sequence + 1, timeout_s=5
        )
        first, second = next(stream), next(stream)
        stream.cancel()
        assert fresh.pool_id == "w0/2"
        assert first.kind == pb.KV_EVENT_KIND_POOL_DROPPED and first.reason == "replaced"
        assert second.kind == pb.KV_EVENT_KIND_POOL_REGISTERED and second.pool_id == "w0/2"
        channel.close()


def test_kill_during_steps_each_step_applied_once(store, allocator_server):
    """A worker keeps stepping while the server is SIGKILLed twice and
    restarted; its retries (same step ids) see every step applied exactly
    once: the answers and the final state equal an in-process run."""
    url, _ = store
    args = ("--state", url)
    every = {"PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "25"}
    spec = PoolSpec("crashy", PoolConfig(32, 4, True, "m"))
    steps = random_steps(seed=11, steps=300)
    reference = EmbeddedAllocator(spec)
    expected = [reference.step(ops) for ops in steps]

    with allocator_server(*args, env=every) as first:
        port = first.port
        worker = GrpcAllocator(first.address, spec, retries=30, backoff_s=0.02, deadline_s=2)
        got: list = []
        done = threading.Event()

        def run():
            for ops in steps:
                got.append(worker.step(ops))
            done.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        servers = [first]
        rng = random.Random(3)
        try:
            for _ in range(2):
                deadline = time.monotonic() + 60
                while len(got) < 40 * len(servers) and t.is_alive() and time.monotonic() < deadline:
                    time.sleep(0.005)
                time.sleep(rng.random() * 0.01)
                servers[-1].kill()
                servers.append(allocator_server(*args, env=every, listen=f"127.0.0.1:{port}"))
            t.join(120)
            assert done.is_set(), "the worker did not get through the restarts"
            assert got == expected
            assert worker.dump() == as_json(reference.pool.to_state())
            assert worker.integrity_problems() == []
            worker.close()
        finally:
            for s in servers[1:]:
                s.terminate()


def test_redis_outage_is_unavailable_then_recovers(store, allocator_server):
    url, redis = store
    if redis is None:
        pytest.skip("needs a private redis-server to stop (PAGEDKV_TEST_REDIS is shared)")
    steps = random_steps(seed=5, steps=4)
    reference = EmbeddedAllocator(PoolSpec("r", PoolConfig(24, 4, True, "m"))).pool
    with allocator_server("--state", url) as server:
        s, md, channel = stub(server.address)
        ref = register(s, md, "r", num_blocks=24)
        for i, ops in enumerate(steps[:3], 1):
            s.Step(pb.StepRequest(pool=ref, step_id=i, ops=encode_ops(ops)))
            execute_step(reference, ops)
        redis.halt()
        request = pb.StepRequest(pool=ref, step_id=4, ops=encode_ops(steps[3]))
        assert code_of(s.Step, request, timeout=10) == C.UNAVAILABLE
        assert (
            code_of(
                s.RegisterPool,
                pb.RegisterPoolRequest(
                    worker_id="late", shape=pb.PoolShape(num_blocks=4, block_size=4)
                ),
                timeout=10,
            )
            == C.UNAVAILABLE
        )
        # reads still work
        assert code_of(s.Heartbeat, pb.HeartbeatRequest(pool=ref), timeout=10) == C.OK
        assert dump(s, md, ref) == as_json(reference.to_state())
        assert server.proc.poll() is None
        redis.start()
        s.Step(request, timeout=10)
        execute_step(reference, steps[3])
        assert dump(s, md, ref) == as_json(reference.to_state())
        channel.close()
        server.kill()
    with allocator_server("--state", url) as again:
        s, md, channel = stub(again.address)
        assert dump(s, md, ref) == as_json(reference.to_state())
        channel.close()
    assert not any("Traceback" in line for line in server.lines)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    index=st.integers(1, 2**64 - 1),
    step_id=st.integers(1, 2**64 - 1),
    prev=st.integers(0, 2**64 - 1),
    pool_id=st.text(min_size=1, max_size=40),
)
def test_step_record_is_protobufs_encoding(seed, index, step_id, prev, pool_id):
    """The journal's step record is spliced around the bytes the step's
    digest covers instead of re-encoding the operations; it must be byte for
    byte what protobuf writes, and read back to the same record."""
    ops = encode_ops(random_steps(seed=seed, steps=1, max_ops=12)[0] if seed % 7 else [])
    digest = ops_digest(ops)
    got = encode_step_record(index, StepRecord(pool_id, step_id, digest, canonical_ops(ops)), prev)
    record = jpb.JournalRecord(
        index=index,
        step=jpb.StepApplied(
            pool_id=pool_id, step_id=step_id, digest=digest, ops=ops, prev_step_id=prev
        ),
    )
    assert got == record.SerializeToString()
    assert jpb.JournalRecord.FromString(got) == record
