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

from allocator_service.codec import encode_ops
from allocator_service.core import Admit
from allocator_service.v1 import allocator_pb2 as pb
from tests.support.allocator import code_of, register, stub

pytestmark = pytest.mark.slow

TTL_S = 3.0
POOLS = 12
IN_FLIGHT = 24  # per pool, six times its slots
BLOCKS = 32768
TOKENS = 16384


def _flood(address: str, stop, ready) -> None:
    """Register POOLS large pools, fill each, then keep IN_FLIGHT integrity
    checks of each in flight until `stop` (answers and refusals alike are
    sent again at once)."""
    s, md, channel = stub(address)
    refs = []
    for i in range(POOLS):
        ref = register(s, md, f"flood-{i}", num_blocks=BLOCKS, block_size=16)
        s.Step(pb.StepRequest(pool=ref, step_id=1, ops=encode_ops([Admit("a", list(range(1, TOKENS + 1)))])),
               timeout=60)
        refs.append(ref)

    def again(ref):
        def send(_=None):
            if not stop.is_set():
                s.GetPoolStats.future(pb.GetPoolStatsRequest(pool=ref, check_integrity=True),
                                      timeout=60).add_done_callback(send)
        return send

    for ref in refs:
        for _ in range(IN_FLIGHT):
            again(ref)()
    ready.set()
    stop.wait(120)
    channel.close()


def test_a_flood_of_slow_reads_from_many_pools_starves_no_heartbeat(allocator_server):
    with allocator_server(env={"PAGEDKV_ALLOCATOR_LEASE_TTL": str(TTL_S)}) as server:
        s, md, channel = stub(server.address)
        ctx = mp.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        flood = ctx.Process(target=_flood, args=(server.address, stop, ready), daemon=True)
        flood.start()
        codes: list[grpc.StatusCode] = []
        try:
            assert ready.wait(300), "the flood did not start"
            bystander = register(s, md, "bystander")
            end = time.monotonic() + 6 * TTL_S
            while time.monotonic() < end:
                try:  # a heartbeat answered later than the lease's half-life is one the worker cannot use
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
