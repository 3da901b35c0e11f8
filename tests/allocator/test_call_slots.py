"""One worker cannot hold every server thread: a pool may have at most
`Limits.max_calls_per_pool` unary calls in flight (`fair_share.CallSlots`); one
more is refused at once (RESOURCE_EXHAUSTED, `pool_calls`), while other
pools, heartbeats and the pool's own step stream go on. A real gRPC server
in this process, whose handling of one pool's GetPoolStats is held open."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.transport import error_reason
from allocator_service.config import Limits, ServiceConfig
from allocator_service.core import Admit, PoolConfig
from allocator_service.fair_share import CallSlots
from allocator_service.rpc.server import create_server
from allocator_service.service import AllocatorService
from allocator_service.wire.codec import encode_ops
from allocator_service.wire.errors import TooManyCalls
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.allocator import register, stub


class HeldServer:
    """A real server (pool and admin tokens) whose GetPoolStats of one pool
    stays in its handler until released; at most 2 slow calls per pool."""

    def __init__(self) -> None:
        self.service = AllocatorService(ServiceConfig(limits=Limits(max_calls_per_pool=2)))
        self.server, port = create_server(
            "127.0.0.1:0", self.service, auth_token="pool-token", admin_token="admin-token"
        )
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.stub, self.md, self.channel = stub(self.address, "pool-token")
        self.admin, self.admin_md, self.admin_channel = stub(self.address, "admin-token")
        self.release = threading.Event()
        self.held = threading.Semaphore(0)
        self.held_pool = ""
        stats = self.service.reads.stats

        def slow_stats(ref, *args, **kw):
            if ref.pool_id == self.held_pool and not kw.get("admin"):
                self.held.release()
                self.release.wait(10)
            return stats(ref, *args, **kw)

        self.service.reads.stats = slow_stats

    def close(self) -> None:
        self.release.set()
        self.channel.close()
        self.admin_channel.close()
        self.server.stop(0).wait()
        self.service.close()


def test_a_pool_past_its_slow_calls_in_flight_is_refused_and_nothing_else_is():
    h = HeldServer()
    s, md = h.stub, h.md
    try:
        heavy, light = register(s, md, "heavy"), register(s, md, "light")
        h.held_pool = heavy.pool_id
        with ThreadPoolExecutor(2) as pool:
            calls = [
                pool.submit(
                    s.GetPoolStats, pb.GetPoolStatsRequest(pool=heavy), metadata=md, timeout=10
                )
                for _ in range(2)
            ]
            for _ in range(2):
                assert h.held.acquire(timeout=10)  # both in the handler now
            with pytest.raises(grpc.RpcError) as refused:
                s.GetPoolStats(pb.GetPoolStatsRequest(pool=heavy), metadata=md, timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_reason(refused.value) == "pool_calls"
            # without the pool's credential: refused for that, and no slot is taken
            stranger = pb.PoolRef(pool_id=heavy.pool_id, credential="not-its-credential")
            with pytest.raises(grpc.RpcError) as denied:
                s.GetPoolStats(pb.GetPoolStatsRequest(pool=stranger), metadata=md, timeout=10)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # meanwhile, answered: another pool's calls; the heavy pool's heartbeat
            # and its unary steps (not slow calls: never refused for its slots)
            assert (
                s.GetPoolStats(
                    pb.GetPoolStatsRequest(pool=light), metadata=md, timeout=10
                ).num_blocks
                == 64
            )
            s.Heartbeat(pb.HeartbeatRequest(pool=heavy), metadata=md, timeout=10)
            step = pb.StepRequest(pool=heavy, step_id=1, ops=encode_ops([Admit("a", [1, 2, 3])]))
            answer = s.Step(step, metadata=md, timeout=10)
            assert list(answer.errors) == [pb.OP_ERROR_NONE] and list(answer.num_stored) == [3]
            # an admin's read of the pool takes none of its slots
            r = h.admin.GetPoolStats(
                pb.GetPoolStatsRequest(pool=pb.PoolRef(pool_id=heavy.pool_id)),
                metadata=h.admin_md,
                timeout=10,
            )
            assert r.num_sequences == 1
            h.release.set()
            assert all(c.result().num_blocks == 64 for c in calls)
        # its calls answered, the pool has its slots back
        assert (
            s.GetPoolStats(pb.GetPoolStatsRequest(pool=heavy), metadata=md, timeout=10).num_blocks
            == 64
        )
        assert (
            h.service.call_slots.in_flight(heavy.pool_id) == 0 and h.service.call_slots.refused == 1
        )
        from prometheus_client import generate_latest

        from allocator_service.rpc.metrics import make_registry

        text = generate_latest(make_registry(h.service)[0]).decode()
        assert "pagedkv_allocator_pool_calls_refused_total 1.0" in text
    finally:
        h.close()


def test_the_workers_client_waits_for_a_slot_instead_of_failing():
    """GrpcAllocator retries a `pool_calls` refusal with its backoff: a
    worker whose stats are read while two are in flight gets its answer."""
    h = HeldServer()
    worker = GrpcAllocator(
        h.address,
        PoolSpec("w", PoolConfig(64, 4, True, "m")),
        auth_token="pool-token",
        backoff_s=0.02,
    )
    try:
        h.held_pool = worker.pool_id
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(worker.stats) for _ in range(2)]
            for _ in range(2):
                assert h.held.acquire(timeout=10)
            third = pool.submit(worker.stats)
            deadline = time.monotonic() + 10
            while h.service.call_slots.refused == 0:  # refused at least once, and retrying
                assert time.monotonic() < deadline, "the third call was never refused"
                time.sleep(0.01)
            assert not third.done()
            h.held_pool = ""  # its retry is not held
            h.release.set()
            assert third.result(timeout=10).num_blocks == 64
            assert all(f.result(timeout=10).num_blocks == 64 for f in first)
    finally:
        worker.close()
        h.close()


@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), max_size=30),
    st.integers(1, 3),
    st.none() | st.integers(1, 5),
)
def test_slots_count_calls_in_flight_per_tenant(events, per_tenant, total):
    """Take (True) or end the oldest call (False) of a tenant: a take is
    refused exactly when the tenant already has `per_tenant` in flight, or
    all tenants together `total`."""
    slots = CallSlots(per_tenant, total)
    open_calls: dict[str, list] = {"a": [], "b": [], "c": []}
    for tenant, take in events:
        if take:
            held = slots.take(tenant)
            everyone = sum(map(len, open_calls.values()))
            if len(open_calls[tenant]) >= per_tenant or (total is not None and everyone >= total):
                with pytest.raises(TooManyCalls):
                    held.__enter__()
            else:
                held.__enter__()
                open_calls[tenant].append(held)
        elif open_calls[tenant]:
            open_calls[tenant].pop(0).__exit__(None, None, None)
        assert all(slots.in_flight(t) == len(c) for t, c in open_calls.items())
        assert slots.in_flight() == sum(map(len, open_calls.values()))
