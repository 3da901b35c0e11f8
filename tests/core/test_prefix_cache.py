"""Hash-chained prefix caching in the core: hits, misses, salts, eviction
order, duplicate holders, all-or-nothing admits, stable hashes."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator_service.core import BlockPool, OutOfBlocks, PoolConfig, hashing, snapshot

B = 4


def make(num_blocks: int = 10, fingerprint: str = "m") -> BlockPool:
    return BlockPool(
        PoolConfig(num_blocks, B, enable_prefix_caching=True, model_fingerprint=fingerprint)
    )


def test_hit_after_free_and_miss_on_other_tokens():
    pool = make()
    a = pool.admit("A", list(range(1, 11)))  # 10 tokens: 2 full blocks + 2
    assert a.cached_tokens == 0 and a.table == [0, 1, 2]
    pool.free("A")
    b = pool.admit("B", list(range(1, 11)))
    assert b.cached_tokens == 8
    assert b.table[:2] == [0, 1] and b.new_blocks == [3]
    assert pool.admit("C", [99] + list(range(2, 11))).cached_tokens == 0
    st = pool.stats()
    assert st.prefix_queried_tokens == 30 and st.prefix_hit_tokens == 8
    assert pool.check_integrity()


def test_hit_on_block_in_use_shares_it():
    pool = make()
    pool.admit("A", list(range(1, 10)))
    b = pool.admit("B", list(range(1, 10)))
    assert b.cached_tokens == 8 and b.table[:2] == [0, 1]
    assert pool.refcounts() == {0: 2, 1: 2, 2: 1, 3: 1}


def test_last_prompt_token_is_never_cached():
    pool = make()
    pool.admit("A", list(range(1, 9)))  # exactly two full blocks, both cached
    pool.free("A")
    # Same 8 tokens: the block holding the last token must be recomputed.
    assert pool.admit("B", list(range(1, 9))).cached_tokens == 4


def test_salt_isolates_tenants():
    pool = make()
    pool.admit("A", list(range(1, 10)), cache_salt="tenant-1")
    assert pool.admit("B", list(range(1, 10)), cache_salt="tenant-2").cached_tokens == 0
    assert pool.admit("C", list(range(1, 10))).cached_tokens == 0
    assert pool.admit("D", list(range(1, 10)), cache_salt="tenant-1").cached_tokens == 8


def test_hand_out_order_uncached_first_then_cached_tail_first():
    pool = make(num_blocks=6)
    pool.admit("A", list(range(1, 10)))  # blocks 0,1 full (cached), 2 partial
    pool.free("A")
    # Uncached (3,4,5 never used, then 2) before cached; cached tail first.
    assert pool.free_order() == [3, 4, 5, 2, 1, 0]
    pool.admit("X", [50] * 12)  # takes 3,4,5 -- no eviction
    assert pool.stats().evictions == 0 and pool.free_order() == [2, 1, 0]
    y = pool.admit("Y", list(range(1, 10)))
    # Hits pulled 0 and 1 out of the middle of the queue; 2 was computed anew.
    assert (y.cached_tokens, y.table, y.new_blocks) == (8, [0, 1, 2], [2])


def test_lru_and_tail_before_head_eviction():
    pool = make(num_blocks=8)
    pool.admit("old", [1] * 8 + [2])  # full blocks 0,1; partial 2
    pool.admit("new", [3] * 8 + [4])  # full blocks 3,4; partial 5
    pool.free("old")
    pool.free("new")
    assert pool.free_order() == [6, 7, 2, 5, 1, 0, 4, 3]
    pool.admit("big", [9] * 20)  # 5 blocks: 6,7,2,5 then evicts 1 (old's tail)
    assert pool.stats().evictions == 1
    assert pool.cached_prefix_tokens([1] * 8 + [2]) == 4  # old's head survives
    assert pool.cached_prefix_tokens([3] * 8 + [4]) == 8  # new intact
    assert pool.free_order() == [0, 4, 3]


def test_duplicate_holders_prefer_in_use_then_evicted_last():
    pool = make(num_blocks=8)
    # A 4-token prompt fills one block but is never looked up whole (last
    # token rule), so A and B each compute their own copy of that block.
    pool.admit("A", [7, 7, 7, 7])
    pool.admit("B", [7, 7, 7, 7])
    assert pool.tables() == {"A": [0], "B": [1]}
    pool.free("A")
    c = pool.admit("C", [7, 7, 7, 7, 8])
    assert c.table[0] == 1  # B's block is in use: taken over A's free copy
    pool.free("C")
    pool.free("B")
    # Both copies free now; A's (freed first) would be evicted first, so a hit
    # takes B's, the one evicted last.
    assert pool.admit("D", [7, 7, 7, 7, 8]).table[0] == 1
    assert pool.check_integrity()


def test_out_of_blocks_admit_with_hits_changes_nothing():
    pool = make(num_blocks=4)
    pool.admit("A", list(range(1, 10)))  # 3 blocks, 0 and 1 cached
    pool.free("A")
    pool.admit("X", [100])  # takes block 3
    before = pool.to_state()
    with pytest.raises(OutOfBlocks):
        # hits 0,1 (both free) and would need 3 more blocks; only 2 are free
        # besides the hits.
        pool.admit("B", list(range(1, 9)) + [50] * 9)
    after = pool.to_state()
    before["counters"]["out_of_blocks"] += 1
    assert after == before


def test_out_of_blocks_copy_on_write_changes_nothing():
    pool = BlockPool(PoolConfig(2, B))
    pool.admit("S1", [1, 2, 3, 4, 5, 6])
    pool.fork("S1", "S2")
    before = pool.to_state()
    with pytest.raises(OutOfBlocks):
        pool.append("S1", [7])
    before["counters"]["out_of_blocks"] += 1
    assert pool.to_state() == before


def test_reset_prefix_cache_forgets_hashes_keeps_order():
    pool = make(num_blocks=6)
    pool.admit("A", list(range(1, 10)))
    pool.free("A")
    assert pool.reset_prefix_cache() == 2
    assert pool.free_order() == [3, 4, 5, 2, 1, 0]
    assert pool.stats().cached_blocks == 0
    assert pool.admit("B", list(range(1, 10))).cached_tokens == 0
    assert pool.check_integrity()


def test_a_sequence_in_use_keeps_its_chain_through_a_reset():
    """A reset clears the hashes of blocks in use, not the chains of their
    sequences: the next block they fill chains from the hashes before it,
    exactly as in a pool that was never reset, and a dump keeps them."""
    tokens = list(range(1, 17))
    pool, never = make(), make()
    for p in (pool, never):
        p.admit("A", tokens[:13])
        p.fork("A", "A2")
    assert pool.reset_prefix_cache() == 3
    for p in (pool, never):
        p.append("A", tokens[13:])
    root = hashing.root_hash("m", B)
    assert (
        pool.index.block_hash[pool.block_table("A")[3]] == hashing.chain_hashes(root, tokens, B)[3]
    )
    assert pool.to_state()["seqs"] == never.to_state()["seqs"]
    clone = BlockPool.from_state(json.loads(json.dumps(pool.to_state())))
    assert clone.to_state() == pool.to_state()
    assert clone.admit("B", tokens + [0]).cached_tokens == 0  # blocks 0-2 are no longer cached
    assert clone.check_integrity() and pool.check_integrity()


def test_chunked_admit_stores_only_the_budget():
    pool = make(num_blocks=10)
    pool.admit("A", list(range(1, 10)))
    r = pool.admit("B", list(range(1, 20)), num_new_tokens=4)
    assert r.cached_tokens == 8 and r.num_stored == 12
    assert pool.num_tokens("B") == 12
    pool.append("B", list(range(13, 20)))
    assert pool.num_tokens("B") == 19 and pool.check_integrity()


def test_state_round_trip_is_exact():
    pool = make(num_blocks=12)
    pool.admit("A", list(range(1, 14)), cache_salt="s")
    pool.fork("A", "A2")
    pool.append("A2", [5, 6])
    pool.admit("B", list(range(1, 14)), cache_salt="s")
    pool.free("A")
    clone = BlockPool.from_state(json.loads(json.dumps(pool.to_state())))
    assert clone.to_state() == pool.to_state()
    for p in (pool, clone):
        p.append("B", [1, 2, 3, 4])
        p.admit("C", list(range(1, 14)), cache_salt="s")
    assert clone.to_state() == pool.to_state()


def test_a_dump_with_a_short_hash_is_refused_with_its_reason():
    """A dump is checked as it is read: a block hash that is not 32 bytes
    (a dump or snapshot that is not ours) is a ValueError naming the block,
    which a snapshot's replay reports as unusable, never a pool with it."""
    pool = make(num_blocks=12)
    pool.admit("A", list(range(1, 14)))
    full, packed = pool.to_state(), snapshot.to_packed(pool)
    full["hash"][1] = full["hash"][1][:-2]
    with pytest.raises(ValueError, match="block 1's hash has 31 bytes; a block hash has 32"):
        BlockPool.from_state(full)
    raw = base64.b64decode(packed["hashes"])
    packed["hashes"] = base64.b64encode(raw[:-1]).decode()
    with pytest.raises(ValueError, match="hash has 31 bytes"):
        BlockPool.from_state(packed)


_HASH_SNIPPET = (
    "from allocator_service.core import hashing;"
    "r = hashing.root_hash('model-x', 16);"
    "print(','.join(h.hex() for h in hashing.chain_hashes(r, list(range(40)), 16, 'salt')))"
)


def test_hashes_identical_across_processes():
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(
            subprocess.run(
                [sys.executable, "-c", _HASH_SNIPPET],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
    mine = ",".join(
        h.hex()
        for h in hashing.chain_hashes(hashing.root_hash("model-x", 16), list(range(40)), 16, "salt")
    )
    assert outs == {mine}
    # The root depends on the model and the block size.
    assert hashing.root_hash("model-x", 16) != hashing.root_hash("model-y", 16)
    assert hashing.root_hash("model-x", 16) != hashing.root_hash("model-x", 32)


def test_bad_input_is_rejected_without_change():
    from allocator_service.core import InvalidArgument, SequenceExists, UnknownSequence

    pool = make()
    pool.admit("A", [1, 2, 3])
    before = pool.to_state()
    for call in (
        lambda: pool.admit("B", [1, -2]),
        lambda: pool.admit("B", [1, 2**32]),
        lambda: pool.admit("B", [1, True]),
        lambda: pool.admit("B", [1.0]),
        lambda: pool.admit("", [1]),
        lambda: pool.append("A", ["x"]),
        lambda: pool.admit("B", [1], num_new_tokens=0),
    ):
        with pytest.raises(InvalidArgument):
            call()
    with pytest.raises(SequenceExists):
        pool.admit("A", [1])
    with pytest.raises(UnknownSequence):
        pool.free("nope")
    with pytest.raises(UnknownSequence):
        pool.fork("nope", "Z")
    assert pool.to_state() == before


def _spec_chain(root: bytes, tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """The module docstring's definition, block by block, written out."""
    import hashlib
    import struct

    out, parent = [], root
    for i in range(len(tokens) // block_size):
        keys = [f"salt:{salt}".encode()] if salt and i == 0 else []
        h = hashlib.sha256(parent)
        h.update(struct.pack("<I", block_size))
        h.update(struct.pack(f"<{block_size}I", *tokens[i * block_size : (i + 1) * block_size]))
        h.update(struct.pack("<I", len(keys)))
        for k in keys:
            h.update(struct.pack("<I", len(k)) + k)
        parent = h.digest()
        out.append(parent)
    return out


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=700),
    st.sampled_from([1, 3, 16]),
    st.sampled_from([None, "", "tenant-ü"]),
)
@settings(max_examples=60, deadline=None)
def test_chain_hashes_are_the_block_by_block_definition(tokens, block_size, salt):
    root = hashing.root_hash("model-x", block_size)
    assert hashing.chain_hashes(root, tokens, block_size, salt) == _spec_chain(
        root, tokens, block_size, salt
    )


PINNED_HASH = "7d4f87ec61107a1b0bf174f775766ff473eb938ed344dd29f706ab8477fcd49c"


def test_chain_hashes_are_pinned():
    """What journals and routers already hold: a change of the encoding is a new HASH_SCHEME."""
    root = hashing.root_hash("model-x", 16)
    assert hashing.chain_hashes(root, list(range(40)), 16, "salt")[-1].hex() == PINNED_HASH
