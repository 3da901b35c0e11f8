"""KV tiers on a hand-worked case, and determinism.

A 4-block pool of 2-token blocks, a host tier of 4 slots and a store of 8
entries: what a free writes through to the store, which evicted block is
saved to which slot, what an admission loads from where, and
`cached_tokens`, step by step (the
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
from allocator_service.core.step import StepAnswer
from allocator_service.core.tier_index import SharedStore, StoreStats, TierStats
from tests.support.allocator import tier_report

CONFIG = PoolConfig(
    4, 2, True, "m", host_blocks=4, layout="L", block_bytes=100, use_shared_store=True
)
A, B, D, E = ([base + i for i in range(7)] for base in (1, 11, 21, 31))


def hashes(tokens: list[int]) -> list[bytes]:
    return chain_hashes(BlockPool(CONFIG, store=SharedStore(0)).root_hash, tokens, 2)


def step(pool: BlockPool, ops: list, **report) -> StepAnswer:
    r = run_step(pool, step_columns(ops, tier_report(**report)))
    assert pool.integrity_problems() == []
    return r


def moves(r: StepAnswer) -> dict:
    """The answer's non-empty tier move columns."""
    return {f: v for f, v in r.moves._asdict().items() if v}


def test_freed_blocks_go_to_the_store_and_evicted_ones_to_the_host_tier() -> None:
    store = SharedStore(8 * 100)
    pool = BlockPool(CONFIG, store=store)
    hA, hB, hD = hashes(A), hashes(B), hashes(D)
    stats = pool.tiers.stats

    # A's 7 tokens take blocks 0-3; its three full blocks are hashed.
    r = step(pool, [Admit("a", A)])
    assert r.appended == [0, 1, 2, 3] and moves(r) == {}

    # A is freed: its cached blocks are written through to the store, tail
    # first. B reuses all four blocks (block 3, unhashed, first, then the
    # cached ones tail first): each evicted hash goes to a host slot, in
    # order; the store has them (pending) already.
    r = step(pool, [Free("a"), Admit("b", B)])
    assert r.appended == [3, 2, 1, 0]
    assert moves(r) == {
        "store_saves": [hA[2], hA[1], hA[0]],
        "store_save_from": [2, 1, 0],
        "host_saves": [2, 0, 1, 1, 0, 2],
    }
    # Not confirmed yet: A is in no tier that finds it.
    assert pool.tier_blocks(hA[:3]) == (0, 0, 0)

    # The worker confirms; B is freed and written through.
    r = step(pool, [Free("b")], saved=[0, 1, 2], store_saved=[hA[2], hA[1], hA[0]])
    assert moves(r) == {"store_saves": [hB[2], hB[1], hB[0]], "store_save_from": [1, 2, 3]}
    assert pool.tier_blocks(hA[:3]) == (0, 3, 0)  # (KV pool, host tier, store): the host tier first

    # A again: its 3 blocks load from the host tier into fresh blocks:
    # block 0 (unhashed), then 1 and 2 (B's, evicted tail first: B's last
    # hash takes the free slot 3; the next finds every other slot pinned by
    # this admission's loads and is skipped). Block 3 computes A's last token.
    r = step(pool, [Admit("c", A)], store_saved=[hB[2], hB[1], hB[0]])
    assert r.appended == [0, 1, 2, 3] and r.cached_tokens == [6] and r.num_stored == [7]
    assert moves(r) == {"host_saves": [1, 3], "host_loads": [2, 0, 1, 1, 0, 2]}
    assert stats.saves_skipped == 2
    assert pool.tier_blocks(hB[:3]) == (0, 0, 3)  # the host save of B's last block is pending

    # B again, once its last block's host save is confirmed: its head from
    # the store, its last block from the host tier. C's blocks it evicts are
    # in both tiers: nothing is saved.
    r = step(pool, [Free("c"), Admit("d", B)], saved=[3])
    assert r.appended == [3, 2, 1, 0] and r.cached_tokens == [0, 6]
    assert moves(r) == {
        "host_loads": [3, 1],
        "store_loads": [hB[0], hB[1]],
        "store_load_to": [3, 2],
    }

    # The worker refused B's head from the store (a bad checksum) and
    # computed it: the entry leaves the index, its key is deleted first of
    # the answer's moves, and freeing D writes the computed block back.
    # D evicts B's blocks: B's last is in the host tier; the other two take
    # the LRU host slots (A's head, then A's second): A leaves the host tier
    # and is still found, in the store.
    r = step(pool, [Free("d"), Admit("e", D)], refused=[hB[0]])
    assert moves(r) == {
        "store_deletes": [hB[0]],
        "store_delete_layouts": ["L"],
        "store_saves": [hB[0]],
        "store_save_from": [3],
        "host_saves": [2, 2, 3, 1],
    }
    assert pool.tier_blocks(hA[:3]) == (0, 1, 2) and stats.host_evictions == 2
    assert stats.refused_loads == 1

    # D is freed: written through, the third save dropping the store's LRU
    # entry (A's last block: a chain's tail was saved, so dropped, first). E
    # evicts D's blocks into the LRU host slots; the third finds only
    # pending slots and is skipped.
    r = step(pool, [Free("e"), Admit("f", E)])
    assert moves(r) == {
        "store_deletes": [hA[2]],
        "store_delete_layouts": ["L"],
        "store_saves": [hD[2], hD[1], hD[0]],
        "store_save_from": [2, 1, 0],
        "host_saves": [2, 0, 1, 3],
    }
    assert stats.saves_skipped == 3

    # The worker's report: two store saves written, one failed (it leaves
    # the index, its key deleted); a refusal of B's second block, which no
    # block of this pool holds any more, is ignored: a pool drops only
    # entries of what it holds. D's head is in no tier, so D is not found.
    r = step(
        pool, [], saved=[0, 3], store_saved=[hD[2], hD[1]], store_failed=[hD[0]], refused=[hB[1]]
    )
    assert moves(r) == {"store_deletes": [hD[0]], "store_delete_layouts": ["L"]}
    assert pool.tier_blocks(hD[:3]) == (0, 0, 0) and pool.tier_blocks(hB[:3]) == (0, 0, 0)
    assert [h for _, h in store.lru.present] == [hA[1], hA[0], hB[2], hB[1], hD[2], hD[1]]
    assert store.lru.used == 700 and list(store.lru.pending) == [("L", hB[0])]
    assert pool.stats().prefix_hit_tokens == 12
    assert stats.host_hit_tokens == 8 and stats.store_hit_tokens == 4
    assert stats.refused_loads == 1 and stats.saves_failed == 1
    assert stats.stale_confirmations == 1


def test_a_pool_refuses_only_entries_it_holds() -> None:
    """A worker's report of a refused store load drops the entry for every
    pool that shares the store, so it counts only for a hash its own pool
    holds: one worker cannot empty the index the others find their prefixes
    in by naming hashes it never loaded."""
    config = PoolConfig(4, 2, True, "m", layout="L", block_bytes=100, use_shared_store=True)
    store = SharedStore(800)
    writer, other = BlockPool(config, store=store), BlockPool(config, store=store)
    store.users = 2
    hA = hashes(A)
    step(writer, [Admit("a", A)])
    r = step(writer, [Free("a")])
    step(writer, [], store_saved=r.moves.store_saves)
    assert other.tier_blocks(hA[:3]) == (0, 0, 3)  # (KV pool, host tier, store)

    # The other pool names A's hashes refused without having loaded them:
    # ignored (counted stale), the entries stay for everyone.
    r = step(other, [], refused=hA[:3])
    assert moves(r) == {} and other.tiers.stats.refused_loads == 0
    assert other.tiers.stats.stale_confirmations == 3
    assert other.tier_blocks(hA[:3]) == (0, 0, 3) and len(store.lru.present) == 3

    # Once it loads A's head and refuses it, the entry leaves the index.
    r = step(other, [Admit("b", A[:3])])
    assert r.cached_tokens == [2] and moves(r)["store_loads"] == [hA[0]]
    r = step(other, [], refused=[hA[0]])
    assert moves(r) == {"store_deletes": [hA[0]], "store_delete_layouts": ["L"]}
    assert other.tiers.stats.refused_loads == 1 and len(store.lru.present) == 2


def test_a_full_store_drops_its_lru_entry() -> None:
    """No host tier: KV -> store at release; a store of two entries drops
    the least recently used present one (a store delete) for a third."""
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
    # has no room for h3, whose write-through is skipped.
    r = step(pool, [Free("c")])
    assert moves(r) == {} and pool.tiers.stats.saves_skipped == 1
    # Confirmed: when h3's block is evicted the store lacks it, so it is
    # saved then, dropping h1, the least recently used entry: a store
    # delete, before it.
    r = step(pool, [Admit("d", [4, 4, 9])], store_saved=[h1, h2])
    assert r.appended == [1, 0]
    assert moves(r) == {
        "store_deletes": [h1],
        "store_delete_layouts": ["L"],
        "store_saves": [h3],
        "store_save_from": [0],
    }
    # A pending entry is not found: C's prompt is computed.
    r = step(pool, [Free("d"), Admit("e", [3, 3, 9])])
    assert r.cached_tokens == [0, 0]
    assert moves(r) == {
        "store_deletes": [h2],
        "store_delete_layouts": ["L"],
        "store_saves": [h4],
        "store_save_from": [1],
    }
    # A dropped pool's unconfirmed saves leave the store.
    assert pool.drop_store_pending() == 2
    assert not store.lru.present and not store.lru.pending and store.lru.used == 0


def test_confirmations_are_checked() -> None:
    pool = BlockPool(CONFIG, store=SharedStore(800))
    with pytest.raises(InvalidArgument, match="slot 4"):
        step(pool, [], saved=[4])
    with pytest.raises(InvalidArgument, match="32-byte"):
        step(pool, [], refused=[b"short"])
    plain = BlockPool(PoolConfig(4, 2, True, "m"))
    with pytest.raises(InvalidArgument, match="without KV tiers"):
        run_step(plain, step_columns([], tier_report(saved=[0])))
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
            ops.append(
                Admit(
                    f"s{n}", rng.choice(convs)[: rng.randrange(2, 10)], None, rng.choice([None, 2])
                )
            )
        out.append(ops)
    return out


def _run(
    pools: list[BlockPool], script: list[list], start: int, pending: list[dict]
) -> list[StepAnswer]:
    """Steps `start:` of `script`, round robin over the two `pools`; each pool's
    worker confirms its last answer's saves (every third one failed) and
    refuses every fifth store load, in its next step."""
    results = []
    for i in range(start, len(script)):
        k = i % len(pools)
        r = run_step(pools[k], step_columns(script[i], tier_report(**pending[k])))
        assert pools[k].integrity_problems() == []
        m = r.moves
        slots = m.host_saves[1::2]
        pending[k] = {
            "saved": [s for j, s in enumerate(slots) if j % 3 != 2],
            "failed": [s for j, s in enumerate(slots) if j % 3 == 2],
            "store_saved": [h for j, h in enumerate(m.store_saves) if j % 3 != 1],
            "store_failed": [h for j, h in enumerate(m.store_saves) if j % 3 == 1],
            "refused": m.store_loads[::5],
        }
        results.append(r)
    return results


def _fresh() -> tuple[list[BlockPool], SharedStore]:
    store = SharedStore(6 * 100)
    pools = [
        BlockPool(
            PoolConfig(
                5, 2, True, "m", host_blocks=hb, layout="L", block_bytes=100, use_shared_store=True
            ),
            store=store,
        )
        for hb in (3, 0)
    ]
    return pools, store


@pytest.mark.parametrize("seed", range(5))
def test_a_replay_rebuilds_the_same_tiers(seed: int) -> None:
    script = _script(seed, 60)
    pools, store = _fresh()
    first = _run(pools, script, 0, [{}, {}])
    assert any(r.moves.host_loads for r in first) and any(r.moves.store_loads for r in first)
    assert any(r.moves.store_deletes for r in first)

    again, store2 = _fresh()
    assert _run(again, script, 0, [{}, {}]) == first
    assert [p.to_state() for p in again] == [p.to_state() for p in pools]
    assert store2.to_state() == store.to_state()

    # Half-way through a snapshot (JSON, as stored), restored into new objects.
    half = len(script) // 2
    mid, _ = _fresh()
    pending: list[dict] = [{}, {}]
    head = _run(mid, script[:half], 0, pending)
    dumps = json.loads(
        json.dumps({"store": mid[0].tiers.store.to_state(), "pools": [p.to_state() for p in mid]})
    )
    restored_store = SharedStore.from_state(dumps["store"])
    restored = [BlockPool.from_state(s, store=restored_store) for s in dumps["pools"]]
    tail = _run(restored, script, half, pending)
    assert head + tail == first
    assert [p.to_state() for p in restored] == [p.to_state() for p in pools]
    assert restored_store.to_state() == store.to_state()


def test_tier_counts_keep_their_dump_keys() -> None:
    """A dump stores each count under the key it always had; a dump written
    before a count existed reads it as 0."""
    tiers = TierStats(refused_loads=3, host_evictions=1).to_state()
    assert list(tiers) == [
        "host_hit_tokens",
        "store_hit_tokens",
        "host_saves",
        "store_saves",
        "host_loads",
        "store_loads",
        "saves_confirmed",
        "saves_failed",
        "saves_skipped",
        "refused",
        "host_evictions",
        "stale_confirmations",
    ]
    assert tiers["refused"] == 3 and TierStats.from_state(tiers) == TierStats(
        refused_loads=3, host_evictions=1
    )
    assert TierStats.from_state({"refused": 2}) == TierStats(refused_loads=2)
    assert StoreStats(refused_drops=2, evictions=5).to_state() == {"refused": 2, "dropped": 5}
    assert StoreStats.from_state({"refused": 2, "dropped": 5}) == StoreStats(2, 5)
