"""What one pool can make a snapshot cost: the packed dump of a pool is
bounded by its shape (16 forks of a whole-pool sequence are not 16 copies of
its table and hashes) and restores exactly; a pool whose part keeps the
snapshot over its bound is dropped loudly while every other pool's snapshot
is written, and the journal stays bounded (a real Redis); a WatchEvents
snapshot streams in bounded pieces."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator_service.config import ServiceConfig
from allocator_service.core import (
    Admit,
    Append,
    BlockPool,
    Fork,
    Free,
    PoolConfig,
    execute_step,
    snapshot,
)
from allocator_service.rpc.servicer import event_message
from allocator_service.service import AllocatorService, PoolRef
from allocator_service.store import registry as state
from allocator_service.store.cut import SNAPSHOT_TOO_LARGE
from allocator_service.store.framing import decode_snapshot, encode_snapshot
from allocator_service.store.journal import open_journal
from allocator_service.wire.bounds import dump_floor, packed_bound
from allocator_service.wire.v1 import allocator_pb2 as pb
from router.prefix_view import PrefixView
from tests.support.allocator import step_call


def packed_json(pool: BlockPool) -> str:
    return snapshot.dumps_chunked(snapshot.to_packed(pool))


def attack_pool(num_blocks: int, block_size: int = 4, forks: int = 15) -> BlockPool:
    """The issue's shape: one admit takes every block, then forks of it."""
    pool = BlockPool(PoolConfig(num_blocks, block_size, True, "m"))
    pool.admit("a", list(range(num_blocks * block_size)))
    for i in range(forks):
        pool.fork("a", f"f{i}")
    return pool


def test_forked_pool_packs_in_a_size_bounded_by_its_shape_and_restores_exactly():
    n = 4096
    pool = attack_pool(n)
    text = packed_json(pool)
    # each sequence: one table segment and one hash segment
    seqs = 16
    assert len(text) <= packed_bound(n, seqs, pool.name_chars, 2 * seqs, 0)
    full = snapshot.dumps_chunked(pool.to_state())
    # what every fork's copied table and hashes cost the full dump
    assert len(full) > 10 * len(text)
    restored = BlockPool.from_state(json.loads(text))
    assert restored.to_state() == pool.to_state()
    assert restored.integrity_problems() == []


seq_ids = st.sampled_from(["a", "b", "c", "d", "e"])
ops = st.lists(
    st.one_of(
        st.builds(
            Admit,
            seq_ids,
            st.lists(st.integers(0, 3), max_size=14),
            st.sampled_from([None, "t"]),
            st.sampled_from([None, 1, 3]),
        ),
        st.builds(Append, seq_ids, st.lists(st.integers(0, 3), max_size=6)),
        st.builds(Free, seq_ids),
        st.builds(Fork, seq_ids, seq_ids),
    ),
    max_size=8,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=12), st.booleans(), st.lists(st.booleans(), max_size=12))
def test_packed_dump_restores_any_state_exactly(steps, caching, resets):
    """Shared prefixes, copy-on-write, duplicate holders of a hash and a
    reset prefix cache (hashes no block holds) all pack and restore exactly,
    within the bound of the shape's worst case."""
    pool = BlockPool(PoolConfig(12, 2, caching, "m"))
    for i, step in enumerate(steps):
        execute_step(pool, step)
        if i < len(resets) and resets[i]:
            pool.reset_prefix_cache()
        text = packed_json(pool)
        assert BlockPool.from_state(json.loads(text)).to_state() == pool.to_state()
        assert dump_floor(pool) <= len(snapshot.dumps_chunked(pool.to_state()))
        tails = sum(len(q.tail) for q in pool.parts().seqs.values())
        assert len(text) <= packed_bound(
            pool.num_blocks, len(pool.parts().seqs), pool.name_chars, 2 * pool.table_entries, tails
        )


def test_a_dump_over_the_answer_limit_is_refused_before_it_is_built():
    """DumpPool of the issue's shape (one admit of every block, 15 forks):
    its full dump would take about 40 MB, more than an answer may (16 MiB).
    It is refused with answer_too_large, in under 1 MiB of allocations
    (nothing built), the pool unchanged; the floor it is refused by is
    within a factor of 2 of the dump's real size."""
    import tracemalloc

    from allocator_service.wire.errors import AnswerTooLarge

    svc = AllocatorService(ServiceConfig())
    r = svc.pools.register(
        "w",
        PoolConfig(
            num_blocks=1 << 15, block_size=4, model_fingerprint="m", enable_prefix_caching=True
        ),
    )
    ref = PoolRef(r.pool_id, r.credential)
    svc.steps.step(ref, 1, *step_call([Admit("a", list(range(4 << 15)))]))
    svc.steps.step(ref, 2, *step_call([Fork("a", f"f{i}") for i in range(15)]), prev_step_id=1)
    pool = svc.registry.pools[r.pool_id].pool
    size = len(snapshot.dumps_chunked(pool.to_state()))
    assert size > svc.limits.max_message_bytes and dump_floor(pool) > size // 2
    before = pool.to_state()
    tracemalloc.start()
    try:
        try:
            svc.reads.dump(ref)
            raise AssertionError("the dump was answered")
        except AnswerTooLarge as refused:
            assert refused.code == "answer_too_large" and "takes at least" in str(refused)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert pool.to_state() == before
    # with two forks it fits, and comes back whole
    svc.steps.step(ref, 3, *step_call([Free(f"f{i}") for i in range(2, 15)]), prev_step_id=2)
    text, last, problems = svc.reads.dump(ref)
    assert json.loads(text) == pool.to_state() and last == 3 and problems == []


def test_a_snapshot_of_the_earlier_format_is_still_read():
    svc = AllocatorService(ServiceConfig())
    r = svc.pools.register(
        "w",
        PoolConfig(num_blocks=16, block_size=2, model_fingerprint="m", enable_prefix_caching=True),
    )
    ref = PoolRef(r.pool_id, r.credential)
    svc.steps.step(ref, 1, *step_call([Admit("a", [1, 2, 3, 4, 5]), Fork("a", "b")]))
    snap = svc.registry.to_snapshot(b"\0" * 32)
    snap["format"] = "pagedkv-allocator-snapshot/1"
    for p, e in zip(snap["pools"], svc.registry.pools.values(), strict=True):
        p["state"] = e.pool.to_state()
    loaded, _ = decode_snapshot(encode_snapshot(snap))
    again = state.Registry.from_snapshot(loaded, svc.events.__class__(16))
    assert again.pools[r.pool_id].pool.to_state() == svc.registry.pools[r.pool_id].pool.to_state()


def test_a_pool_too_big_to_snapshot_is_dropped_and_every_other_pool_is_snapshotted(redis_store):
    with redis_store() as (url, _):
        config = ServiceConfig(snapshot_every=4, max_snapshot_bytes=96 << 10)
        journal = open_journal(url)
        svc = AllocatorService(config, journal)
        victim = svc.pools.register(
            "victim",
            PoolConfig(
                num_blocks=64, block_size=4, model_fingerprint="m", enable_prefix_caching=True
            ),
        )
        victim_ref = PoolRef(victim.pool_id, victim.credential)
        hog = svc.pools.register(
            "hog",
            PoolConfig(
                num_blocks=2048, block_size=4, model_fingerprint="m", enable_prefix_caching=True
            ),
        )
        hog_ref = PoolRef(hog.pool_id, hog.credential)
        # Legal: ids of 256 characters, two sequences per block at most.
        svc.steps.step(hog_ref, 1, *step_call([Admit("x" * 256, list(range(2048 * 4)))]))
        forks = [Fork("x" * 256, f"{i:0>256}") for i in range(400)]
        svc.steps.step(hog_ref, 2, *step_call(forks))
        for i in range(3, 12):
            svc.steps.step(
                victim_ref, i, *step_call([Admit(f"s{i}", [i, i + 1, i + 2, i + 3, i + 4])])
            )
        assert hog.pool_id not in svc.registry.pools
        assert svc.durable.pools_dropped_for_size == 1
        # The snapshot holds the victim; the journal was trimmed to it.
        loaded = journal.load(take_ownership=False)
        snap, _ = decode_snapshot(loaded.snapshot)
        assert [p["pool_id"] for p in snap["pools"]] == [victim.pool_id]
        assert len(loaded.entries) < config.snapshot_every
        # The hog's worker finds its pool gone (and why, in the event stream).
        dropped = [e for e in svc.events.read(1, 10_000, 0)[0] if e.pool_id == hog.pool_id]
        assert dropped[-1].kind == "pool_dropped" and dropped[-1].reason == SNAPSHOT_TOO_LARGE
        before = svc.registry.pools[victim.pool_id].pool.to_state()
        journal.close()
        again = AllocatorService(config, open_journal(url))
        assert list(again.registry.pools) == [victim.pool_id]
        assert again.registry.pools[victim.pool_id].pool.to_state() == before


def test_a_watch_snapshot_streams_in_bounded_pieces_read_as_it_goes():
    """WatchEvents' snapshot (`cached_blocks`) comes in pieces of at most
    `chunk` blocks, each read when it is sent (no copy of the whole pool per
    watcher): a change between two pieces shows in the later one, and the
    pieces with the events numbered from the start replayed on them are
    exactly the pool's index."""
    svc = AllocatorService(ServiceConfig())
    r = svc.pools.register(
        "w",
        PoolConfig(num_blocks=64, block_size=1, model_fingerprint="m", enable_prefix_caching=True),
    )
    ref = PoolRef(r.pool_id, r.credential)
    svc.steps.step(ref, 1, *step_call([Admit("a", list(range(41)))]))
    cursor = svc.events.published
    pieces = svc.reads.cached_blocks(16)
    first = next(pieces)
    # Free "a", and let "b" evict its tail's blocks (the cached free queue's head).
    svc.steps.step(ref, 2, *step_call([Free("a"), Admit("b", [7] * 40)]))
    rest = list(pieces)
    index = svc.registry.pools[r.pool_id].pool.index.block_hash
    assert all(len(ids) <= 16 for _, ids, _ in [first, *rest])
    for _, ids, hashes in rest:  # read after the step: as the pool is now
        assert hashes == [index[b] for b in ids]
    view = PrefixView()
    view.begin()
    for pool_id, ids, hashes in [first, *rest]:
        view.apply(
            pb.KvEvent(
                kind=pb.KV_EVENT_KIND_POOL_CACHED,
                pool_id=pool_id,
                block_ids=ids,
                block_hashes=b"".join(hashes),
            )
        )
    for e in svc.events.read(cursor, 10_000, 0)[0]:
        view.apply(event_message(e))
    view.apply(pb.KvEvent(kind=pb.KV_EVENT_KIND_SNAPSHOT_END))
    assert view.blocks(r.pool_id) == {b: h for b, h in enumerate(index) if h is not None}
