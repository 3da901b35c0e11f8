"""The bounded cost of a pool (core/limits.py): what its sequences may hold,
whatever legal operations arrive, refused per operation with `PoolLimit`
having changed nothing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator_service.core import (
    Admit,
    Append,
    BlockPool,
    Fork,
    InvalidArgument,
    PoolConfig,
    PoolLimit,
    execute_step,
)
from allocator_service.core.limits import (
    MAX_TOKEN_ID,
    MIN_SEQUENCES,
    MIN_TABLE_ENTRIES,
    SEQUENCES_PER_BLOCK,
    TABLE_ENTRIES_PER_BLOCK,
    max_sequences,
    max_table_entries,
)
from allocator_service.core.validation import check_tokens, tokens_ok


def dumped(pool: BlockPool) -> str:
    return json.dumps(pool.to_state(), sort_keys=True)


def test_bounds_follow_the_shape():
    assert max_table_entries(1) == MIN_TABLE_ENTRIES
    assert max_table_entries(10_000) == TABLE_ENTRIES_PER_BLOCK * 10_000
    assert max_sequences(1) == MIN_SEQUENCES
    assert max_sequences(10_000) == SEQUENCES_PER_BLOCK * 10_000


@pytest.mark.parametrize("prefix", [False, True])
def test_deep_forks_stop_at_the_entry_bound(prefix):
    """A fork of an L-block sequence adds L entries and no block: the forks
    that would pass the pool's bound are refused and change nothing."""
    n = 256
    pool = BlockPool(PoolConfig(num_blocks=n, block_size=4, enable_prefix_caching=prefix))
    pool.admit("p", list(range(n * 4 - 1)))  # every block, tail of 3 tokens
    ops = [Fork("p", f"c{i}") for i in range(200)]
    results = execute_step(pool, ops)
    ok = sum(r.ok for r in results)
    assert ok == pool.max_table_entries // n - 1  # the parent holds n entries
    refused = [r for r in results if not r.ok]
    assert {r.error for r in refused} == {"pool_limit"}
    assert "table entries" in refused[0].message or "block-table entries" in refused[0].message
    assert pool.table_entries == (ok + 1) * n <= pool.max_table_entries
    assert pool.check_integrity()
    before = dumped(pool)
    with pytest.raises(PoolLimit):
        pool.fork("p", "one-more")
    assert dumped(pool) == before


def test_sequences_stop_at_the_sequence_bound():
    pool = BlockPool(PoolConfig(num_blocks=8, block_size=4))
    results = execute_step(pool, [Admit(f"e{i}", []) for i in range(MIN_SEQUENCES + 10)])
    assert sum(r.ok for r in results) == MIN_SEQUENCES
    assert {r.error for r in results[MIN_SEQUENCES:]} == {"pool_limit"}
    before = dumped(pool)
    with pytest.raises(PoolLimit):
        pool.fork("e0", "child")
    with pytest.raises(PoolLimit):
        pool.admit("x", [1, 2])
    assert dumped(pool) == before
    pool.free("e0")
    pool.admit("x", [1, 2])
    assert pool.check_integrity()


def test_append_and_admit_count_entries_and_free_returns_them():
    pool = BlockPool(PoolConfig(num_blocks=2048, block_size=1, enable_prefix_caching=True))
    prompt = list(range(100))
    pool.admit("a", prompt)
    assert pool.table_entries == 100
    pool.admit("b", prompt)  # shares 99 cached blocks: 100 entries more
    assert pool.table_entries == 200
    pool.append("a", [7, 8, 9])
    assert pool.table_entries == 203
    pool.fork("a", "a2")
    pool.append("a2", [1])  # a full last block: a new entry, no copy
    assert pool.table_entries == 203 + 103 + 1
    pool.free("b")
    assert pool.table_entries == 207
    assert pool.check_integrity()
    restored = BlockPool.from_state(pool.to_state())
    assert restored.table_entries == pool.table_entries


def test_an_append_over_the_bound_is_refused_whole():
    pool = BlockPool(PoolConfig(num_blocks=64, block_size=1))  # bound: MIN_TABLE_ENTRIES
    pool.admit("a", [1] * 60)
    for i in range(16):
        pool.fork("a", f"f{i}")  # 17 x 60 = 1020 entries, 4 free blocks
    pool.admit("b", [1])
    pool.fork("b", "b2")
    room = pool.max_table_entries - pool.table_entries
    assert (room, pool.num_free_blocks) == (2, 3)
    before = dumped(pool)
    (r,) = execute_step(pool, [Append("b", [1] * 3)])  # 3 blocks are free, 2 entries left
    assert not r.ok and r.error == "pool_limit"
    assert dumped(pool) == before
    (r,) = execute_step(pool, [Append("b", [1] * room)])
    assert r.ok and pool.table_entries == pool.max_table_entries
    assert pool.check_integrity()


def test_an_empty_salt_is_refused():
    pool = BlockPool(PoolConfig(num_blocks=8, block_size=2, enable_prefix_caching=True))
    with pytest.raises(InvalidArgument, match="non-empty"):
        pool.admit("a", [1, 2, 3], cache_salt="")
    with pytest.raises(InvalidArgument, match="non-empty"):
        pool.cached_prefix_tokens([1, 2, 3], "")
    (r,) = execute_step(pool, [Admit("a", [1, 2, 3], "")])
    assert r.error == "invalid_argument"
    assert not pool.has_sequence("a")
    pool.admit("a", [1, 2, 3], cache_salt="t")
    assert pool.cached_prefix_tokens([1, 2, 3], "t") == 2
    assert pool.cached_prefix_tokens([1, 2, 3], None) == 0


def test_names_are_bounded_in_characters():
    from allocator_service.core.limits import MAX_SALT_LEN, MAX_SEQ_ID_LEN, MIN_NAME_CHARS

    pool = BlockPool(PoolConfig(num_blocks=100, block_size=4))  # 200 sequences, MIN_NAME_CHARS
    each = MAX_SEQ_ID_LEN + MAX_SALT_LEN
    ops = [
        Admit(f"{i}".ljust(MAX_SEQ_ID_LEN, "x"), [], "s" * MAX_SALT_LEN)
        for i in range(MIN_SEQUENCES + 1)
    ]
    results = execute_step(pool, ops)
    assert sum(r.ok for r in results) == MIN_NAME_CHARS // each == MIN_SEQUENCES
    assert results[-1].error == "pool_limit" and "characters" in results[-1].message
    pool.free(ops[0].seq)
    pool.admit("short", [], "t")
    before = dumped(pool)
    with pytest.raises(PoolLimit, match="characters"):
        pool.admit("y" * MAX_SEQ_ID_LEN, [], "s" * MAX_SALT_LEN)
    with pytest.raises(PoolLimit, match="characters"):
        pool.fork(ops[1].seq, "z" * MAX_SEQ_ID_LEN)  # the child is charged its parent's salt
    assert dumped(pool) == before
    assert pool.name_chars == (MIN_SEQUENCES - 1) * each + len("short") + 1
    assert BlockPool.from_state(pool.to_state()).name_chars == pool.name_chars
    assert pool.check_integrity()


_TOKENISH = st.one_of(
    st.integers(min_value=-3, max_value=MAX_TOKEN_ID + 3),
    st.sampled_from([0, MAX_TOKEN_ID, MAX_TOKEN_ID + 1, -1, 2**70]),
    st.booleans(),
    st.floats(allow_nan=False, min_value=0, max_value=10),
    st.text(max_size=2),
    st.none(),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TOKENISH, max_size=40), st.sampled_from([list, tuple]))
def test_the_token_check_is_one_rule_over_every_kind_of_sequence(tokens, kind):
    # an int (not a bool, not a float) in [0, MAX_TOKEN_ID], each one, in a list or not
    want = all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens)
    assert tokens_ok(kind(tokens)) is want
    if want:
        check_tokens(kind(tokens))
    else:
        with pytest.raises(InvalidArgument, match="token ids must be integers"):
            check_tokens(kind(tokens))
