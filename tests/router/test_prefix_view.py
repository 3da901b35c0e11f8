"""The router's copy of the allocator's prefix caches (`router.prefix_view`),
kept from WatchEvents (a snapshot, then every event), against a real
allocator process: block for block the hashes DumpPool shows, and the
prefix MatchPrefix finds, wherever in a workload the snapshot was taken;
a stream that breaks is rebuilt from a new snapshot."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from itertools import count

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.router_client import RouterClient
from allocator_service.core import Admit, Append, PoolConfig
from allocator_service.core.hashing import prompt_chain
from allocator_service.rpc.servicer import watched_kinds
from allocator_service.wire.v1 import allocator_pb2 as pb
from router.discovery import Discovery
from router.prefix_view import PrefixView
from tests.support.allocator import random_steps

_ids = count()


@pytest.fixture(scope="module")
def server(allocator_server):
    with allocator_server(env={"PAGEDKV_ALLOCATOR_LEASE_TTL": "60"}) as s:
        yield s


class Follower:
    """A thread applying one WatchEvents stream (with a snapshot) to a view."""

    def __init__(self, address: str, view: PrefixView, packed: bool = True) -> None:
        self.client = RouterClient(address)
        self.stream = self.client.watch_events(snapshot=True, packed=packed)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.view = view
        self.thread.start()

    def _run(self) -> None:
        try:
            for event in self.stream:
                self.view.apply(event)
        except grpc.RpcError:
            pass  # cancelled at the end

    def close(self) -> None:
        self.stream.cancel()
        self.thread.join(5)
        self.client.close()


def dumped_hashes(pool: GrpcAllocator) -> dict[int, bytes]:
    return {b: bytes.fromhex(h) for b, h in enumerate(pool.dump()["hash"]) if h}


def wait_for(
    view: PrefixView, pool: GrpcAllocator, pool_id: str, timeout: float = 10.0
) -> dict[int, bytes]:
    """The pool's hashes once the view shows the same (events arrive a moment
    after the step that caused them), else what DumpPool says at the end."""
    deadline = time.monotonic() + timeout
    want = dumped_hashes(pool)
    while (not view.synced or view.blocks(pool_id) != want) and time.monotonic() < deadline:
        time.sleep(0.02)
    return want


def matched_tokens(
    view: PrefixView, pool_id: str, tokens: list[int], size: int, salt: str | None
) -> int:
    hashes = prompt_chain("m", tokens, size, salt)
    return view.cached_blocks(pool_id, hashes) * size


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([1, 2, 4]),
    snapshot_at=st.floats(0, 1),
    resets=st.booleans(),
    packed=st.booleans(),
)
def test_the_view_holds_what_the_allocator_holds(
    server, seed, block_size, snapshot_at, resets, packed
):
    worker_id = f"view-{next(_ids)}"
    pool = GrpcAllocator(
        server.address,
        PoolSpec(
            worker_id, PoolConfig(12, block_size, model_fingerprint="m", enable_prefix_caching=True)
        ),
    )
    steps = random_steps(seed, 30)
    start = int(snapshot_at * len(steps))
    rng = random.Random(seed)
    view = PrefixView()
    follower = None
    try:
        for i, ops in enumerate(steps):
            if i == start:  # the snapshot taken part way through the workload
                follower = Follower(server.address, view, packed)
            pool.step(ops)
            if resets and rng.random() < 0.1:
                pool.reset_prefix_cache()
        if follower is None:
            follower = Follower(server.address, view, packed)
        want = wait_for(view, pool, pool.pool_id)
        assert view.synced
        assert view.blocks(pool.pool_id) == want  # block for block
        assert view.held_blocks(pool.pool_id) == len(want) and view.held_blocks("no such pool") == 0
        router = RouterClient(server.address)
        try:
            for _ in range(8):  # and the prefixes MatchPrefix finds for prompts like the workload's
                tokens = [rng.randrange(6) for _ in range(rng.randint(2, 16))]
                salt = rng.choice([None, "tenant"])
                held = {m.pool_id: m.cached_tokens for m in router.match_prefix("m", tokens, salt)}
                assert (
                    matched_tokens(view, pool.pool_id, tokens, block_size, salt)
                    == held[pool.pool_id]
                )
        finally:
            router.close()
    finally:
        if follower is not None:
            follower.close()
        pool.close()


def test_pools_stepped_at_once_while_the_snapshot_is_read(server):
    """Three pools' workloads in three threads, the snapshot taken while they
    run: each pool's events interleave with the others' (and with batches
    published out of their pools' order), and every pool's view is exact."""
    pools = [
        GrpcAllocator(
            server.address,
            PoolSpec(
                f"view-c{i}-{next(_ids)}",
                PoolConfig(16, 2, model_fingerprint="m", enable_prefix_caching=True),
            ),
        )
        for i in range(3)
    ]
    view = PrefixView()
    half = threading.Barrier(4)

    def run(pool: GrpcAllocator, seed: int) -> None:
        steps = random_steps(seed, 40)
        for i, ops in enumerate(steps):
            if i == len(steps) // 2:
                half.wait(10)
            pool.step(ops)

    threads = [threading.Thread(target=run, args=(p, 100 + i)) for i, p in enumerate(pools)]
    for t in threads:
        t.start()
    half.wait(10)
    follower = Follower(server.address, view)  # while the other halves run
    try:
        for t in threads:
            t.join(60)
        held = 0
        for pool in pools:
            want = wait_for(view, pool, pool.pool_id)
            assert view.blocks(pool.pool_id) == want
            held += len(want)
        assert held > 0  # the workloads cached something: the comparison is not of empty views
    finally:
        follower.close()
        for pool in pools:
            pool.close()


def test_a_dropped_pool_leaves_the_view_and_a_snapshot_sees_every_pool(server):
    a = GrpcAllocator(
        server.address,
        PoolSpec(
            f"view-a-{next(_ids)}",
            PoolConfig(16, 2, model_fingerprint="m", enable_prefix_caching=True),
        ),
    )
    b = GrpcAllocator(
        server.address,
        PoolSpec(
            f"view-b-{next(_ids)}",
            PoolConfig(16, 2, model_fingerprint="m", enable_prefix_caching=True),
        ),
    )
    view = PrefixView()
    follower = None
    try:
        for pool, prompt in ((a, [1, 2, 3, 4, 5]), (b, [5, 4, 3, 2, 1])):
            pool.step([Admit("x", prompt)])
            pool.step([Append("x", [6])])  # its blocks computed: hashed, so cached
        follower = Follower(server.address, view)
        for pool in (a, b):
            want = wait_for(view, pool, pool.pool_id)
            assert view.blocks(pool.pool_id) == want != {}
        a.close()  # deregistered: POOL_DROPPED
        deadline = time.monotonic() + 10
        while view.blocks(a.pool_id) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert view.blocks(a.pool_id) == {} and view.blocks(b.pool_id) != {}
    finally:
        if follower is not None:
            follower.close()
        b.close()


def test_discovery_rebuilds_the_view_after_the_allocator_restarts(allocator_server, tmp_path):
    """Kill -9 and a restart on the same port with the state in Redis-free
    memory: the pools are gone; the stream breaks, the view stops being in
    step (the router asks MatchPrefix meanwhile), and a new snapshot shows
    what the new process holds."""
    from pagedkv.stack import free_port

    listen = f"127.0.0.1:{free_port('127.0.0.1')}"
    first = allocator_server(env={"PAGEDKV_ALLOCATOR_LEASE_TTL": "60"}, listen=listen)
    pool = GrpcAllocator(
        first.address,
        PoolSpec(
            f"view-r-{next(_ids)}",
            PoolConfig(16, 2, model_fingerprint="m", enable_prefix_caching=True),
        ),
        retries=0,
    )
    view = PrefixView()
    discovery = Discovery(RouterClient(first.address), refresh_s=0.2, view=view)
    discovery.start()
    second = None
    try:
        pool.step([Admit("x", [1, 2, 3, 4, 5])])
        pool.step([Append("x", [6])])
        want = wait_for(view, pool, pool.pool_id)
        assert view.blocks(pool.pool_id) == want != {}
        snapshots = view.snapshots
        first.kill()
        deadline = time.monotonic() + 10
        while view.synced and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not view.synced
        second = allocator_server(env={"PAGEDKV_ALLOCATOR_LEASE_TTL": "60"}, listen=listen)
        deadline = time.monotonic() + 20
        while (view.snapshots == snapshots or not view.synced) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert view.synced and view.snapshots > snapshots
        assert view.blocks(pool.pool_id) == {}  # the new process holds no pool
    finally:
        discovery.close()
        with contextlib.suppress(Exception):  # its allocator was restarted without it
            pool.close()
        for s in (first, second):
            if s is not None:
                s.terminate()


def test_a_big_pools_snapshot_comes_packed(server):
    """20,010 cached blocks: three POOL_CACHED events (8,192 blocks at most
    each), not one message per block, and the view built from them exact."""
    pool = GrpcAllocator(
        server.address,
        PoolSpec(
            f"view-big-{next(_ids)}",
            PoolConfig(20_480, 1, model_fingerprint="m", enable_prefix_caching=True),
        ),
    )
    rng = random.Random(7)
    client = RouterClient(server.address)
    try:
        for i in range(5):
            pool.step([Admit(f"s{i}", [rng.randrange(1000) for _ in range(4001)])])
            pool.step([Append(f"s{i}", [1])])
        want = dumped_hashes(pool)
        assert len(want) == 20_010
        stream = client.watch_events(
            snapshot=True, kinds=[pb.KV_EVENT_KIND_POOL_CACHED], timeout_s=10
        )
        view, mine = PrefixView(), []
        view.begin()
        for event in stream:
            view.apply(event)
            if event.pool_id == pool.pool_id:
                mine.append(len(event.block_ids))
            if event.kind == pb.KV_EVENT_KIND_SNAPSHOT_END:
                break
        stream.cancel()
        assert mine == [8192, 8192, 3626] and view.synced and view.blocks(pool.pool_id) == want
        # With the pool's free blocks, as a listing would say them (the pool idle meanwhile).
        assert view.free_blocks(pool.pool_id) == pool.stats().free_blocks
    finally:
        client.close()
        pool.close()


def test_a_packed_stream_sends_a_run_of_block_events_as_one(server):
    """An admit whose prompt fills 5 blocks, then an append that fills a
    sixth: the plain stream has one BLOCK_STORED per block; the packed one
    carries at least the admit's five as one BLOCKS_CHANGED, and unpacked it
    is the plain stream, sequence numbers included."""
    client = RouterClient(server.address)
    # Both from the same number: the head now, which a snapshot's end names.
    probe = client.watch_events(snapshot=True, kinds=[pb.KV_EVENT_KIND_POOL_DROPPED], timeout_s=10)
    head = next(probe).sequence
    probe.cancel()
    plain = client.watch_events(from_sequence=head, timeout_s=10)
    packed = client.watch_events(from_sequence=head, packed=True, timeout_s=10)
    pool = GrpcAllocator(
        server.address,
        PoolSpec(
            f"view-p-{next(_ids)}",
            PoolConfig(16, 2, model_fingerprint="m", enable_prefix_caching=True),
        ),
    )
    try:
        pool.step([Admit("x", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])])
        pool.step([Append("x", [12])])
        pool.close()  # POOL_DROPPED ends what each stream is read for

        def mine(stream) -> list[pb.KvEvent]:
            got = []
            for e in stream:
                if e.pool_id == pool.pool_id:
                    got.append(e)
                    if e.kind == pb.KV_EVENT_KIND_POOL_DROPPED:
                        return got
            return got

        one_by_one, runs = mine(plain), mine(packed)

        def expanded(events) -> list[tuple]:
            out = []
            for e in events:
                if e.kind != pb.KV_EVENT_KIND_BLOCKS_CHANGED:
                    out.append((e.sequence, e.kind, e.block_id, e.block_hash))
                    continue
                for i, block in enumerate(e.block_ids):
                    kind = (
                        pb.KV_EVENT_KIND_BLOCK_REMOVED
                        if e.removed[i]
                        else pb.KV_EVENT_KIND_BLOCK_STORED
                    )
                    out.append((e.sequence + i, kind, block, e.block_hashes[32 * i : 32 * i + 32]))
            return out

        # The admit's 5 blocks are one run (with the append's sixth when one read took both).
        changed = [e for e in runs if e.kind == pb.KV_EVENT_KIND_BLOCKS_CHANGED]
        assert changed and len(changed[0].block_ids) >= 5 and not any(changed[0].removed)
        # A packed stream's block events carry the pool's free blocks (16 less the 6 it holds)
        # unless the pool was gone when the message was built (it is closed right after).
        assert all(e.free_blocks == 10 for e in runs if e.HasField("free_blocks"))
        assert not any(e.HasField("free_blocks") for e in one_by_one)  # a plain stream is as it was
        assert len(runs) < len(one_by_one)
        assert expanded(runs) == expanded(one_by_one)  # the same events, numbers included
    finally:
        plain.cancel()
        packed.cancel()
        client.close()


def test_a_snapshot_follows_the_kinds_filter_and_refuses_a_starting_number(server):
    client = RouterClient(server.address)
    try:
        only_pools = client.watch_events(
            snapshot=True, kinds=[pb.KV_EVENT_KIND_POOL_DROPPED], timeout_s=3
        )
        first = next(only_pools)
        assert first.kind == pb.KV_EVENT_KIND_SNAPSHOT_END and first.sequence > 0
        only_pools.cancel()
        with pytest.raises(grpc.RpcError) as err:
            next(client.watch_events(from_sequence=5, snapshot=True, timeout_s=3))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The packed kinds stand for what they pack.
        assert watched_kinds([pb.KV_EVENT_KIND_BLOCKS_CHANGED]) == {"block_stored", "block_removed"}
        assert (
            watched_kinds([pb.KV_EVENT_KIND_POOL_CACHED, pb.KV_EVENT_KIND_SNAPSHOT_END])
            == frozenset()
        )
    finally:
        client.close()
