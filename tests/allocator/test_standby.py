"""The hot standby (`store/leader.py`): the leader lease and the fence in
Redis, a standby that follows the journal and takes over, and a client with
both addresses that follows the leader. Real Redis, real allocator
processes, real SIGKILL; the drill with SIGSTOP and workers is
tests/drills/test_standby.py."""

from __future__ import annotations

import time

import grpc
import pytest

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.transport import error_reason, open_channel
from allocator_service.core import PoolConfig
from allocator_service.core.step import Admit, Append, Free
from allocator_service.store.framing import encode_entry, head_marker
from allocator_service.store.journal import RedisJournal
from allocator_service.wire.errors import LEADER_KEY, StoreFenced
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import allocator_pb2_grpc as pb_grpc
from pagedkv.stack.probes import grpc_health_ok

LEASE_S = 0.5
ENV = {"PAGEDKV_ALLOCATOR_LEADER_LEASE": str(LEASE_S)}
SERVICE = pb.DESCRIPTOR.services_by_name["Allocator"].full_name


def test_a_claim_fences_the_earlier_leader_and_its_refused_write_changes_nothing(redis_store):
    with redis_store() as (url, _):
        old = RedisJournal(url, address="old:1", lease_s=LEASE_S)
        new = RedisJournal(url, address="new:1", lease_s=LEASE_S)
        try:
            assert old.claim(force=False)
            entry, chain = encode_entry(bytes(32), b"record 1")
            old.append(entry, b"", head_marker(1, chain))
            assert not new.claim(force=False), "a live lease is not taken"
            assert new.leader.endswith(" old:1")
            time.sleep(LEASE_S + 0.2)  # the old leader stops renewing (a pause)
            assert new.claim(force=False)
            # the next fencing epoch
            assert int(new.token.split(":")[0]) == int(old.token.split(":")[0]) + 1
            before = (
                old.client.lrange(old._keys["journal"], 0, -1),
                old.client.get(old._keys["head"]),
            )
            entry2, chain2 = encode_entry(chain, b"record 2")
            with pytest.raises(StoreFenced):
                old.append(entry2, head_marker(1, chain), head_marker(2, chain2))
            assert (
                old.client.lrange(old._keys["journal"], 0, -1),
                old.client.get(old._keys["head"]),
            ) == before
            assert old.renew() == 0, "the deposed leader's renewal says so"
            assert new.renew() == 1
            new.release()
            assert old.client.get(old._keys["leader"]) is None, "a released lease is free at once"
        finally:
            old.close()
            new.close()


OPS = [
    [Admit("a", list(range(1, 10)))],
    [Admit("b", list(range(1, 7))), Append("a", [10])],
    [Append("a", [11, 12]), Append("b", [7])],
    [Free("b"), Admit("c", list(range(20, 33)))],
    [Append("a", [13]), Append("c", [33, 34, 35])],
]


def _stub(address: str):
    return pb_grpc.AllocatorStub(open_channel(address))


def test_the_standby_follows_takes_over_after_sigkill_and_answers_a_retry_with_the_journaled_answer(
    redis_store, allocator_server
):
    spec = PoolSpec("w", PoolConfig(num_blocks=24, block_size=4, enable_prefix_caching=True))
    with (
        redis_store() as (url, _),
        allocator_server("--state", url, env=ENV) as leader,
        allocator_server("--state", url, "--standby", env=ENV) as standby,
    ):
        assert grpc_health_ok(standby.address)  # the process is sound ...
        assert not grpc_health_ok(standby.address, service=SERVICE)  # ... and serves no call
        with pytest.raises(grpc.RpcError) as refused:
            _stub(standby.address).ListPools(pb.ListPoolsRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_reason(refused.value) == "not_leader"
        assert dict(refused.value.trailing_metadata())[LEADER_KEY] == leader.address

        reference = EmbeddedAllocator(spec)
        client = GrpcAllocator(f"{standby.address},{leader.address}", spec, heartbeat=False)
        for ops in OPS[:3]:
            assert list(client.step(ops)) == list(reference.step(ops))
        # the next step, sent by hand to the leader: answered (and journaled) ...
        request = pb.StepRequest(pool=client._ref, step_id=4, prev_step_id=3)
        from allocator_service.core import step_columns
        from allocator_service.wire.codec import fill_ops

        fill_ops(request.ops, step_columns(OPS[3]))
        first = _stub(leader.address).Step(request, timeout=5)
        leader.kill()  # ... then the leader dies before the worker saw the answer
        t0 = time.monotonic()
        while True:  # the worker retries the same step at the standby
            try:
                again = _stub(standby.address).Step(request, timeout=5)
                break
            except grpc.RpcError as err:
                assert (
                    err.code() == grpc.StatusCode.UNAVAILABLE and error_reason(err) == "not_leader"
                )
                assert time.monotonic() - t0 < 30
                time.sleep(0.02)
        took = time.monotonic() - t0
        assert again.SerializeToString() == first.SerializeToString(), (
            "the same step id, the same answer"
        )
        reference.step(OPS[3])
        client._step_id = client._answered = 4  # what the worker knows once it has the answer
        assert list(client.step(OPS[4])) == list(reference.step(OPS[4]))
        stats = client.stats()
        assert stats == reference.stats()
        assert client.integrity_problems() == []
        assert grpc_health_ok(standby.address, service=SERVICE)
        print(f'DRILL {{"standby_took_over_s": {took:.3f}, "lease_s": {LEASE_S}}}')
        client.close()


def test_an_idle_workers_heartbeats_follow_the_new_leader(redis_store, allocator_server):
    """A worker that sends no step through the failover still renews its
    pool's lease at the new leader: its pool is not dropped."""
    spec = PoolSpec("idle", PoolConfig(num_blocks=8, block_size=4))
    env = {**ENV, "PAGEDKV_ALLOCATOR_LEASE_TTL": "2"}
    with (
        redis_store() as (url, _),
        allocator_server("--state", url, env=env) as leader,
        allocator_server("--state", url, "--standby", env=env) as standby,
    ):
        # heart-beats every TTL / 3
        client = GrpcAllocator(f"{leader.address},{standby.address}", spec)
        client.step([Admit("a", [1, 2, 3])])
        leader.kill()
        # the takeover, then past the pool's lease at the new leader
        time.sleep(LEASE_S + 2 * 2.0 + 1.0)
        assert client.stats().num_sequences == 1  # no PoolLost: the same pool, renewed all along
        assert client.pool_id == "idle/1"
        client.close()
