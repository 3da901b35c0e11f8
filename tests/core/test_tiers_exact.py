"""KV tiers on a hand-worked case, and determinism.

A 4-block pool of 2-token blocks, a host tier of 4 slots and a store of 8
entries: which block is saved to which slot, what falls to the store, what
an admission loads from where, and `cached_tokens`, step by step (the
reasoning is in each step's comment). Then: the same steps replayed into a
fresh pool and store, or through `to_state`/`from_state` half-way, give the
same answers and the same tier state.
"""

from __future__ import annotations

import json
import random

import pytest

from allocator_service.core import (
    Admit,
    BlockPool,
    Free,
    InvalidArgument,
    PoolConfig,
    run_step,
    step_columns,
)
from allocator_service.core.hashing import chain_hashes
from allocator_service.core.step import StepResult
from allocator_service.core.tiers import SharedStore

CONFIG = PoolConfig(4, 2, True, "m", host_blocks=4, layout="L", block_bytes=100, use_shared_store=True)
A, B, D, E = ([base + i for i in range(7)] for base in (1, 11, 21, 31))


def hashes(tokens: list[int]) -> list[bytes]:
    return chain_hashes(BlockPool(CONFIG, store=SharedStore(0)).root_hash, tokens, 2)


def step(pool: BlockPool, ops: list, **report) -> StepResult:
    r = run_step(pool, step_columns(ops)._replace(**report))
    assert pool.integrity_problems() == []
    return r


def moves(r: StepResult) -> dict:
    """The answer's non-empty tier move columns."""
    return {f: v for f, v in r._asdict().items() if f in MOVES and v}


MOVES = StepResult._fields[StepResult._fields.index("error_messages") + 1 :]


def test_saves_fall_down_and_loads_come_back() -> None:
    store = SharedStore(8 * 100)
    pool = BlockPool(CONFIG, store=store)
    hA, hB, hD = hashes(A), hashes(B), hashes(D)

    # A's 7 tokens take blocks 0-3; its three full blocks are hashed.
    r = step(pool, [Admit("a", A)])
    assert r.appended == [0, 1, 2, 3] and moves(r) == {}

    # A is freed: block 3 (no hash) is first out, then the cached ones tail
    # first (2, 1, 0). B reuses all four: each evicted hash goes to the host
    # tier, slots in order.
    r = step(pool, [Free("a"), Admit("b", B)])
    assert r.appended == [3, 2, 1, 0]
    assert moves(r) == {"host_saves": [2, 0, 1, 1, 0, 2]}
    # Not confirmed yet: nothing is findable in the host tier.
    assert pool.tier_blocks(hA[:3]) == (0, 0, 0)

    # The worker confirms the three saves; B is freed.
    r = step(pool, [Free("b")], saved=[0, 1, 2])
    assert moves(r) == {}
    assert pool.tier_blocks(hA[:3]) == (0, 3, 0)

    # A again: its 3 cached blocks are in the host tier. Each takes a fresh
    # block and is loaded into it: block 0 (uncached), then 1 and 2 (B's
    # cached blocks, tail first: B's last hash goes to the free slot 3; the
    # next finds every other slot pinned by this admission's loads and is
    # skipped), and block 3 computes A's last token.
    r = step(pool, [Admit("c", A)])
    assert r.appended == [0, 1, 2, 3] and r.cached_tokens == [6] and r.num_stored == [7]
    assert moves(r) == {"host_saves": [1, 3], "host_loads": [2, 0, 1, 1, 0, 2]}
    assert pool.tiers.counters["saves_skipped"] == 2

    # C is freed and D reuses its blocks: A's hashes are in the host tier
    # already, so nothing is saved.
    r = step(pool, [Free("c"), Admit("d", D)], saved=[3])
    assert r.appended == [3, 2, 1, 0] and moves(r) == {}

    # E reuses D's blocks. The host tier is full (LRU: A's three, loaded
    # last step, then B's): each of D's hashes takes the LRU slot, whose
    # entry is first saved to the store (store saves come before host saves).
    r = step(pool, [Free("d"), Admit("e", E)])
    assert r.appended == [0, 1, 2, 3]
    assert moves(r) == {
        "store_saves": [hA[0], hA[1], hA[2]], "store_save_from": [2, 1, 0],
        "host_saves": [1, 2, 2, 1, 3, 0],
    }
    assert pool.tier_blocks(hA[:3]) == (0, 0, 0)  # pending in the store

    # Confirmed; A again finds its blocks in the store, and loads them into
    # blocks 3, 2, 1; the blocks it takes evict E's hashes into the host
    # tier, whose LRU entries (B's, then D's) fall to the store first.
    r = step(pool, [Free("e"), Admit("f", A)], saved=[2, 1, 0], store_saved=hA[:3])
    assert r.appended == [3, 2, 1, 0] and r.cached_tokens == [0, 6]
    assert moves(r) == {
        "store_saves": [hB[2], hD[2], hD[1]], "store_save_from": [3, 2, 1],
        "host_saves": [2, 3, 1, 2, 0, 1],
        "store_loads": [hA[0], hA[1], hA[2]], "store_load_to": [3, 2, 1],
    }
    assert pool.stats().prefix_hit_tokens == 12
    assert pool.tiers.counters["host_hit_tokens"] == 6 and pool.tiers.counters["store_hit_tokens"] == 6

    # The worker's report: one store save written, one failed, and one load
    # refused (a bad checksum): the failed and refused entries leave the
    # index, and their keys are deleted, first of the answer's moves.
    r = step(pool, [], store_saved=[hB[2], hD[1]], store_failed=[hD[2]], refused=[hA[1]])
    assert moves(r) == {"store_deletes": [hD[2], hA[1]], "store_delete_layouts": ["L", "L"]}
    assert list(store.lru.present) == [("L", hA[0]), ("L", hA[2]), ("L", hB[2]), ("L", hD[1])]
    assert store.lru.used == 400 and not store.lru.pending
    assert pool.tiers.counters["refused"] == 1 and pool.tiers.counters["saves_failed"] == 1


def test_a_full_store_drops_its_lru_entry() -> None:
    """No host tier: KV -> store directly; a store of two entries drops the
    least recently used present one (a store delete) for a third."""
    config = PoolConfig(2, 2, True, "m", layout="L", block_bytes=100, use_shared_store=True)
    store = SharedStore(200)
    pool = BlockPool(config, store=store)
    h1, h2, h3, h4 = (hashes([t, t])[0] for t in (1, 2, 3, 4))
    step(pool, [Admit("a", [1, 1, 9])])
    r = step(pool, [Free("a"), Admit("b", [2, 2, 9])])
    assert moves(r) == {"store_saves": [h1], "store_save_from": [0]}
    r = step(pool, [Free("b"), Admit("c", [3, 3, 9])])
    assert moves(r) == {"store_saves": [h2], "store_save_from": [1]}
    # A pending entry is never a victim: with h1 and h2 pending the store
    # has no room for h3, whose save is skipped.
    r = step(pool, [Free("c"), Admit("d", [4, 4, 9])])
    assert moves(r) == {} and pool.tiers.counters["saves_skipped"] == 1
    # Confirmed: C's prompt is in no tier (computed), and the next save (h4)
    # drops h1, the least recently used entry: a store delete, before it.
    r = step(pool, [Free("d"), Admit("e", [3, 3, 9])], store_saved=[h1, h2])
    assert r.cached_tokens == [0, 0]
    assert moves(r) == {"store_deletes": [h1], "store_delete_layouts": ["L"],
                        "store_saves": [h4], "store_save_from": [1]}
    # A dropped pool's unconfirmed saves leave the store.
    assert pool.drop_store_pending() == 1
    assert list(store.lru.present) == [("L", h2)] and not store.lru.pending


def test_confirmations_are_checked() -> None:
    pool = BlockPool(CONFIG, store=SharedStore(800))
    with pytest.raises(InvalidArgument, match="slot 4"):
        step(pool, [], saved=[4])
    with pytest.raises(InvalidArgument, match="32-byte"):
        step(pool, [], refused=[b"short"])
    plain = BlockPool(PoolConfig(4, 2, True, "m"))
    with pytest.raises(InvalidArgument, match="without KV tiers"):
        run_step(plain, step_columns([])._replace(saved=[0]))
    with pytest.raises(InvalidArgument, match="need prefix caching"):
        PoolConfig(4, 2, False, host_blocks=2)
    with pytest.raises(InvalidArgument, match="none was given"):
        BlockPool(PoolConfig(4, 2, True, layout="L", block_bytes=1, use_shared_store=True))


# ------------------------------------------------------------- determinism
def _script(seed: int, steps: int) -> list[list]:
    rng = random.Random(seed)
    convs = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]
    out, lives, n = [], ([], []), 0
    for i in range(steps):
        live = lives[i % 2]  # the steps go round robin over two pools
        ops = []
        for sid in live[: len(live) - rng.randrange(2)]:  # all, or all but the newest
            ops.append(Free(sid))
        del live[: len(ops)]
        for _ in range(rng.randrange(1, 3)):
            n += 1
            live.append(f"s{n}")
            ops.append(Admit(f"s{n}", rng.choice(convs)[: rng.randrange(2, 10)], None, rng.choice([None, 2])))
        out.append(ops)
    return out


def _run(pools: list[BlockPool], script: list[list], start: int, pending: list[dict]) -> list[StepResult]:
    """Steps `start:` of `script`, round robin over the two `pools`; each pool's
    worker confirms its last answer's saves (every third one failed) and
    refuses every fifth store load, in its next step."""
    results = []
    for i in range(start, len(script)):
        k = i % len(pools)
        r = run_step(pools[k], step_columns(script[i])._replace(**pending[k]))
        assert pools[k].integrity_problems() == []
        slots = r.host_saves[1::2]
        pending[k] = {"saved": [s for j, s in enumerate(slots) if j % 3 != 2],
                      "failed": [s for j, s in enumerate(slots) if j % 3 == 2],
                      "store_saved": [h for j, h in enumerate(r.store_saves) if j % 3 != 1],
                      "store_failed": [h for j, h in enumerate(r.store_saves) if j % 3 == 1],
                      "refused": r.store_loads[::5]}
        results.append(r)
    return results


def _fresh() -> tuple[list[BlockPool], SharedStore]:
    store = SharedStore(6 * 100)
    pools = [BlockPool(PoolConfig(5, 2, True, "m", host_blocks=hb, layout="L", block_bytes=100,
                                  use_shared_store=True), store=store) for hb in (3, 0)]
    return pools, store


@pytest.mark.parametrize("seed", range(5))
def test_a_replay_rebuilds_the_same_tiers(seed: int) -> None:
    script = _script(seed, 60)
    pools, store = _fresh()
    first = _run(pools, script, 0, [{}, {}])
    assert any(r.host_loads for r in first) and any(r.store_loads for r in first)
    assert any(r.store_deletes for r in first)

    again, store2 = _fresh()
    assert _run(again, script, 0, [{}, {}]) == first
    assert [p.to_state() for p in again] == [p.to_state() for p in pools]
    assert store2.to_state() == store.to_state()

    # Half-way through a snapshot (JSON, as stored), restored into new objects.
    half = len(script) // 2
    mid, _ = _fresh()
    pending: list[dict] = [{}, {}]
    head = _run(mid, script[:half], 0, pending)
    dumps = json.loads(json.dumps({"store": mid[0].tiers.store.to_state(), "pools": [p.to_state() for p in mid]}))
    restored_store = SharedStore.from_state(dumps["store"])
    restored = [BlockPool.from_state(s, store=restored_store) for s in dumps["pools"]]
    tail = _run(restored, script, half, pending)
    assert head + tail == first
    assert [p.to_state() for p in restored] == [p.to_state() for p in pools]
    assert restored_store.to_state() == store.to_state()
