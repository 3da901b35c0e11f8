"""Leases against a real server with a 1-second TTL: a silent pool is
dropped with its blocks, a heart-beating one is untouched, and the silent
worker's client re-registers and tells the worker (PoolLost)."""

from __future__ import annotations

import time

import pytest

from allocator_service.client import PoolLost, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.router_client import RouterClient
from allocator_service.core import Admit, Append, PoolConfig
from allocator_service.wire.v1 import allocator_pb2 as pb

TTL = 1.0


def test_silent_pool_is_dropped_and_others_untouched(allocator_server):
    with allocator_server(env={"PAGEDKV_ALLOCATOR_LEASE_TTL": str(TTL)}) as server:
        router = RouterClient(server.address)
        events = router.watch_events(from_sequence=1, timeout_s=10)
        # heart-beats every TTL/3
        alive = GrpcAllocator(server.address, PoolSpec("alive", PoolConfig(16, 4)))
        silent = GrpcAllocator(
            server.address, PoolSpec("silent", PoolConfig(16, 4)), heartbeat=False
        )
        assert alive.lease_ttl_s == TTL
        alive.step([Admit("a", [1, 2, 3, 4, 5])])
        silent.step([Admit("a", [1, 2, 3, 4, 5])])
        before = alive.dump()
        time.sleep(TTL * 2.5)
        assert alive.dump() == before
        dropped = []
        for e in events:
            if e.kind == pb.KV_EVENT_KIND_POOL_DROPPED:
                dropped.append((e.pool_id, e.reason))
                break
        events.cancel()
        assert dropped == [("silent/1", "lease_expired")]
        with pytest.raises(PoolLost):
            silent.step([Append("a", [6])])
        assert silent.pool_id == "silent/2" and silent.stats().num_sequences == 0
        assert silent.step([Admit("a", [1])])[0].ok
        alive.close()
        silent.close()
        router.close()


def test_leases_are_rearmed_after_a_restart(allocator_server, redis_store):
    """After a restart the state comes back with a fresh lease for every
    pool (from the restart time), then silent pools expire as usual."""
    with redis_store() as (url, _):
        ttl = 3 * TTL  # room for a restart under load inside one lease
        args, env = ("--state", url), {"PAGEDKV_ALLOCATOR_LEASE_TTL": str(ttl)}
        with allocator_server(*args, env=env) as server:
            worker = GrpcAllocator(
                server.address, PoolSpec("rearm", PoolConfig(16, 4)), heartbeat=False
            )
            worker.step([Admit("a", [1, 2, 3])])
            server.kill()
        time.sleep(ttl + 0.5)  # longer than the TTL: only a re-armed lease survives it
        with allocator_server(*args, env=env, listen=f"127.0.0.1:{server.port}"):
            assert worker.block_table("a") == [0]
            time.sleep(ttl * 1.5)
            with pytest.raises(PoolLost):
                worker.block_table("a")
            worker.close()
