"""Reserved slots (async scheduling): an APPEND holds slots for tokens not
known yet; their values come first in the sequence's next APPEND; a block is
hashed (findable) only once every slot of it has a value; a sequence with
reserved slots cannot be forked; an UNRESERVE gives them back; snapshots and
integrity checks know them."""

from __future__ import annotations

import pytest

from allocator_service.core import (
    Admit,
    Append,
    BlockPool,
    Fork,
    Free,
    InvalidArgument,
    OutOfBlocks,
    PoolConfig,
    Unreserve,
    execute_step,
)


def pool(num_blocks: int = 8, block_size: int = 4, caching: bool = True) -> BlockPool:
    return BlockPool(PoolConfig(num_blocks, block_size, caching, "m"))


def test_reserve_then_fill_hashes_only_when_the_values_come():
    p = pool()
    p.admit("a", [1, 2, 3])  # block 0 holds 3 tokens
    r = p.append("a", [], reserve=1)  # the 4th slot, its token being sampled
    assert (r.keep, r.new_blocks, r.copies) == (1, [], [])
    assert p.num_tokens("a") == 4 and p.stats().tokens_stored == 4
    assert p.index.block_hash[0] is None  # full, but one value unknown: not findable
    assert p.cached_prefix_tokens([1, 2, 3, 9, 5]) == 0
    r = p.append("a", [9], reserve=1)  # the value of slot 4, and slot 5 reserved
    assert (r.keep, r.new_blocks) == (1, [1])
    assert p.index.block_hash[0] is not None  # now findable
    assert p.cached_prefix_tokens([1, 2, 3, 9, 5]) == 4
    assert p.cached_prefix_tokens([1, 2, 3, 8, 5]) == 0
    assert p.integrity_problems() == []


def test_values_fill_reserved_slots_before_new_ones():
    p = pool(block_size=2)
    p.admit("a", [1])
    p.append("a", [], reserve=2)  # slots 1 and 2: block 1 is new
    assert p.block_table("a") == [0, 1] and p.num_tokens("a") == 3
    r = p.append("a", [7, 8, 9, 4])  # two fill the reserved slots, two are new: slots 3, 4
    assert (r.keep, r.new_blocks) == (2, [2])
    assert p.num_tokens("a") == 5
    assert p.integrity_problems() == []
    # The chain is that of [1, 7, 8, 9, 4], whichever way it arrived.
    q = pool(block_size=2)
    q.admit("b", [1, 7, 8, 9, 4])
    assert p._seqs["a"].chain(p.index.block_hash) == q._seqs["b"].chain(q.index.block_hash)


def test_a_sequence_with_reserved_slots_cannot_be_forked_and_nothing_changes():
    p = pool()
    p.admit("a", [1, 2])
    p.append("a", [], reserve=1)
    before = p.to_state()
    [r] = execute_step(p, [Fork("a", "child")])
    assert not r.ok and r.error == "invalid_argument" and "reserved" in r.message
    assert p.to_state() == before


def test_reserving_is_all_or_nothing():
    p = pool(num_blocks=2, block_size=2)
    p.admit("a", [1, 2, 3])
    before = p.to_state()
    del before["counters"]
    with pytest.raises(OutOfBlocks):
        p.append("a", [4], reserve=2)  # slot 3 fits, slots 4 and 5 need a block there is none of
    with pytest.raises(InvalidArgument):
        p.append("a", [], reserve=-1)
    after = p.to_state()
    assert after.pop("counters")["out_of_blocks"] == 1
    assert after == before


def test_free_with_reserved_slots_leaves_nothing_findable():
    p = pool(block_size=2)
    p.admit("a", [1, 2, 3])
    p.append("a", [], reserve=1)  # block 1 full, its last value unknown
    p.free("a")
    # Block 1 is a plain free block (handed out before any cached one); the
    # prompt's full block 0 stays cached, evicted last.
    assert p.free_order() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert p.index.block_hash[1] is None and p.index.block_hash[0] is not None


def test_snapshot_keeps_reservations_and_reads_old_snapshots():
    p = pool()
    p.admit("a", [1, 2, 3])
    p.append("a", [], reserve=1)
    state = p.to_state()
    assert state["seqs"]["a"]["reserved"] == 1
    again = BlockPool.from_state(state)
    assert again.integrity_problems() == []
    again.append("a", [4])
    assert again.index.block_hash[0] is not None
    old = pool()
    old.admit("b", [1, 2])
    assert "reserved" not in old.to_state()["seqs"]["b"]  # a stored snapshot's format, unchanged
    assert BlockPool.from_state(old.to_state())._seqs["b"].reserved == 0


def test_the_columns_carry_reservations_only_when_some_op_reserves():
    from allocator_service.core import step_columns

    assert step_columns([Admit("a", [1]), Append("a", [2])]).num_reserved == []
    cols = step_columns(
        [Free("x"), Append("a", [2], 1), Append("b", [3]), Append("c", [], 2), Free("y")]
    )
    assert cols.num_reserved == [0, 1, 0, 2, 0]
    cols = step_columns([Free("x"), Unreserve("a", 3)])  # the count an UNRESERVE gives back
    assert (cols.kinds, cols.num_tokens, cols.num_reserved) == ([1, 5], [0, 0], [0, 3])


def test_unreserve_gives_back_the_trailing_blocks_of_reserved_slots():
    p = pool(block_size=2)
    p.admit("a", [1, 2, 3])  # blocks 0, 1 (slot 3 of block 1 empty)
    r = p.append("a", [], reserve=5)  # slots 3..7: block 1's last, blocks 2 and 3
    assert (r.keep, r.new_blocks) == (2, [2, 3]) and p.num_tokens("a") == 8
    [res] = execute_step(p, [Unreserve("a", 3)])  # slots 5..7: block 3 and half of block 2
    assert res.ok and (res.keep, res.append) == (3, [])
    assert p.block_table("a") == [0, 1, 2] and p.num_tokens("a") == 5
    assert p.free_order() == [4, 5, 6, 7, 3]  # block 3 back at the end of the plain free queue
    assert p.integrity_problems() == []
    # The two reserved slots left take their values as before; nothing new.
    r = p.append("a", [4, 5])
    assert (r.keep, r.new_blocks) == (3, [])
    assert p.cached_prefix_tokens([1, 2, 3, 4, 5, 9]) == 4
    assert p.integrity_problems() == []


def test_unreserve_refuses_more_than_the_reserved_slots_and_changes_nothing():
    p = pool()
    p.admit("a", [1, 2])
    p.append("a", [], reserve=2)
    before = p.to_state()
    results = execute_step(p, [Unreserve("a", 3), Unreserve("a", 0), Unreserve("ghost", 1)])
    assert [r.error for r in results] == [
        "invalid_argument",
        "invalid_argument",
        "unknown_sequence",
    ]
    assert p.to_state() == before
    [r] = execute_step(p, [Unreserve("a", 2)])  # all of them: the prompt's block stays
    assert r.ok and r.keep == 1 and p.num_tokens("a") == 2
    assert p.integrity_problems() == []


def test_an_admission_holds_its_reservation_from_the_start():
    """The slots a request reserves at admission (a server that reserves up
    front): its table holds them at once, their values fill them in order,
    and nothing past them takes a block."""
    p = pool(num_blocks=8, block_size=4)
    r = p.admit("a", [1, 2, 3, 4, 5], reserve=7)  # 12 slots: blocks 0, 1, 2
    assert (r.num_stored, r.new_blocks, r.table) == (5, [0, 1, 2], [0, 1, 2])
    assert p.num_tokens("a") == 12 and p.to_state()["seqs"]["a"]["reserved"] == 7
    # only full blocks of values
    assert p.index.block_hash[0] is not None and p.index.block_hash[1] is None
    r = p.append("a", [6, 7, 8, 9, 10, 11, 12])  # the values of all seven: no new block
    assert (r.keep, r.new_blocks) == (3, [])
    assert p.cached_prefix_tokens(list(range(1, 13)) + [0]) == 12
    assert p.integrity_problems() == []
    # A chunk of a prompt (num_new_tokens) holds its reservation after the chunk.
    r = p.admit("b", [9] * 6, None, 2, reserve=6)  # stores 2, holds 8: blocks 3, 4
    assert (r.num_stored, r.table, p.num_tokens("b")) == (2, [3, 4], 8)
    assert p.integrity_problems() == []


def test_a_reservation_that_does_not_fit_admits_nothing():
    p = pool(num_blocks=3, block_size=4)
    before = p.to_state()
    del before["counters"]
    with pytest.raises(OutOfBlocks):
        p.admit("a", [1, 2], reserve=11)  # 13 slots: 4 blocks of 3
    with pytest.raises(InvalidArgument):
        p.admit("a", [1, 2], reserve=-1)
    after = p.to_state()
    assert after.pop("counters")["out_of_blocks"] == 1
    assert after == before
    assert p.admit("a", [1, 2], reserve=10).table == [0, 1, 2]  # 12 slots: all three


def test_the_columns_carry_an_admission_reservation():
    from allocator_service.core import step_columns

    cols = step_columns([Free("x"), Admit("a", [1, 2], None, None, 6), Admit("b", [3])])
    assert (cols.kinds, cols.num_reserved) == ([1, 3, 3], [0, 6, 0])
    [res] = execute_step(pool(), [Admit("a", [1, 2], None, None, 6)])
    assert res.ok and (res.append, res.num_stored) == ([0, 1], 2)
