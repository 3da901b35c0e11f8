"""One worker cannot hold every server thread: a pool may have at most
`Limits.max_calls_per_pool` unary calls in flight (`call_slots.py`); one
more is refused at once (RESOURCE_EXHAUSTED, `pool_calls`), while other
pools, heartbeats and the pool's own step stream go on. A real gRPC server
in this process, whose handling of one pool's GetPoolStats is held open."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allocator_service.call_slots import CallSlots
from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator, error_reason
from allocator_service.config import Limits, ServiceConfig
from allocator_service.core import Admit, PoolConfig
from allocator_service.errors import TooManyCalls
from allocator_service.server import create_server
from allocator_service.service import AllocatorService
from allocator_service.v1 import allocator_pb2 as pb
from tests.support.allocator import register, stub


def test_a_pool_past_its_calls_in_flight_is_refused_and_nobody_else_waits():
    service = AllocatorService(ServiceConfig(limits=Limits(max_calls_per_pool=2)))
    server, port = create_server("127.0.0.1:0", service)
    server.start()
    s, md, channel = stub(f"127.0.0.1:{port}")
    release = threading.Event()
    held = threading.Semaphore(0)
    stats = service.stats

    def slow_stats(ref, *args, **kw):
        if ref.pool_id == heavy.pool_id:  # the heavy pool's calls stay in flight until released
            held.release()
            release.wait(10)
        return stats(ref, *args, **kw)

    service.stats = slow_stats
    try:
        heavy, light = register(s, md, "heavy"), register(s, md, "light")
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(s.GetPoolStats, pb.GetPoolStatsRequest(pool=heavy), timeout=10) for _ in range(2)]
            for _ in range(2):
                assert held.acquire(timeout=10)  # both in the handler now
            with pytest.raises(grpc.RpcError) as refused:
                s.GetPoolStats(pb.GetPoolStatsRequest(pool=heavy), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_reason(refused.value) == "pool_calls"
            # meanwhile, answered: another pool's calls and the heavy pool's heartbeat
            assert s.GetPoolStats(pb.GetPoolStatsRequest(pool=light), timeout=10).num_blocks == 64
            s.Heartbeat(pb.HeartbeatRequest(pool=heavy), timeout=10)
            release.set()
            assert all(c.result().num_blocks == 64 for c in calls)
        # its calls answered, the pool has its slots back
        assert s.GetPoolStats(pb.GetPoolStatsRequest(pool=heavy), timeout=10).num_blocks == 64
        assert service.call_slots.in_flight(heavy.pool_id) == 0 and service.call_slots.refused == 1
    finally:
        release.set()
        channel.close()
        server.stop(0).wait()
        service.close()


def test_a_worker_stepping_while_its_metrics_are_read_stays_within_its_slots():
    """The worker's own client: steps on its stream, stats beside them."""
    service = AllocatorService()
    server, port = create_server("127.0.0.1:0", service)
    server.start()
    worker = GrpcAllocator(f"127.0.0.1:{port}", PoolSpec("w", PoolConfig(64, 4, True, "m")))
    try:
        with ThreadPoolExecutor(2) as pool:
            reads = [pool.submit(worker.stats) for _ in range(20)]
            for i in range(20):
                worker.step([Admit(f"s{i}", [i, i + 1])])
            assert all(r.result().num_blocks == 64 for r in reads)
        assert service.call_slots.refused == 0
    finally:
        worker.close()
        server.stop(0).wait()
        service.close()


@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), max_size=30), st.integers(1, 3))
def test_slots_count_calls_in_flight_per_tenant(events, per_tenant):
    """Take (True) or end the oldest call (False) of a tenant: a take is
    refused exactly when the tenant already has `per_tenant` in flight."""
    slots = CallSlots(per_tenant)
    open_calls: dict[str, list] = {"a": [], "b": [], "c": []}
    for tenant, take in events:
        if take:
            held = slots.take(tenant)
            if len(open_calls[tenant]) >= per_tenant:
                with pytest.raises(TooManyCalls):
                    held.__enter__()
            else:
                held.__enter__()
                open_calls[tenant].append(held)
        elif open_calls[tenant]:
            open_calls[tenant].pop(0).__exit__(None, None, None)
        assert all(slots.in_flight(t) == len(c) for t, c in open_calls.items())
