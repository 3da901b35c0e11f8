"""Many pools' slow reads cannot take the server's threads from anyone's
heartbeats: a real allocator process, and a flood from another process of
integrity checks (GetPoolStats with check_integrity) of many large pools,
far more in flight than their slots allow. A bystander pool that only sends
heartbeats keeps its lease, and every one of its heartbeats is answered
within the time its lease gives it."""

from __future__ import annotations

import multiprocessing as mp
import time

import grpc
import pytest

from allocator_service.wire.v1 import allocator_pb2 as pb
from pagedkv.bench.attackers import slow_read_flood
from tests.support.allocator import code_of, register, stub

pytestmark = pytest.mark.slow

TTL_S = 3.0
# The flood's defaults: 12 pools of 32,768 blocks, 24
# integrity checks of each in flight (six times its slots).


def test_a_flood_of_slow_reads_from_many_pools_starves_no_heartbeat(allocator_server):
    with allocator_server(env={"PAGEDKV_ALLOCATOR_LEASE_TTL": str(TTL_S)}) as server:
        s, md, channel = stub(server.address)
        ctx = mp.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        flood = ctx.Process(target=slow_read_flood, args=(server.address, stop, ready), daemon=True)
        flood.start()
        codes: list[grpc.StatusCode] = []
        try:
            assert ready.wait(300), "the flood did not start"
            bystander = register(s, md, "bystander")
            # three leases long: a pool whose heartbeats were starved would have lost its lease
            end = time.monotonic() + 3 * TTL_S
            while time.monotonic() < end:
                # a heartbeat answered later than the lease's half-life is one the worker cannot use
                try:
                    s.Heartbeat(pb.HeartbeatRequest(pool=bystander), timeout=TTL_S / 2)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())
                time.sleep(TTL_S / 6)
            # the bystander's pool is still the one it registered (its slow read waits for a slot)
            kept = code_of(s.GetPoolStats, pb.GetPoolStatsRequest(pool=bystander), timeout=30)
        finally:
            stop.set()
            flood.join(60)
            channel.close()
    assert kept in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED), kept
    assert codes and all(c == grpc.StatusCode.OK for c in codes), codes
