"""Property-based (hypothesis) test of the allocator core.

Thousands of random admit/append/fork/free/reset operations, reservations of
slots for tokens not known yet and their return (unreserve), prefix caching on
and off. After every operation the pool's integrity holds, and a shadow KV
array written through each sequence's flat slot ids (copies applied first, as
a worker would) reads back every sequence's tokens in order. That also proves
every prefix-cache hit points at blocks that really hold the prompt's tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

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

# A tiny alphabet so that prompts often share prefixes and hit the cache.
tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=14)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool
        self.tokens: dict[str, list[int]] = {}  # each sequence's tokens with known values
        self.reserved: dict[str, int] = {}  # slots held after them for values not known yet
        self.kv: dict[int, int] = {}  # flat slot id -> token written there
        self.counter = 0

    @initialize(
        num_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 3, 4, 8]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.pool = BlockPool(PoolConfig(num_blocks, block_size, caching, "prop"))
        self.B = block_size

    # -- helpers -----------------------------------------------------------
    def _slot(self, seq: str, pos: int) -> int:
        table = self.pool.block_table(seq)
        return table[pos // self.B] * self.B + pos % self.B

    def _write(self, seq: str, start: int, toks: list[int]) -> None:
        for i, t in enumerate(toks):
            self.kv[self._slot(seq, start + i)] = t

    def _copy(self, copies) -> None:
        for src, dst in copies:
            for o in range(self.B):
                if src * self.B + o in self.kv:
                    self.kv[dst * self.B + o] = self.kv[src * self.B + o]

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    def _unchanged_on_failure(self, call):
        before = self.pool.to_state()
        try:
            return call()
        except OutOfBlocks:
            after = self.pool.to_state()
            assert after["counters"]["out_of_blocks"] == before["counters"]["out_of_blocks"] + 1
            after["counters"]["out_of_blocks"] -= 1
            assert after == before
            return None

    # -- rules -------------------------------------------------------------
    @rule(
        toks=tokens_st,
        salt=st.sampled_from([None, None, "t1"]),
        budget=st.sampled_from([None, None, 1, 3]),
    )
    def admit(self, toks, salt, budget) -> None:
        sid = self._new_id()
        r = self._unchanged_on_failure(lambda: self.pool.admit(sid, toks, salt, budget))
        if r is None:
            return
        assert r.cached_tokens % self.B == 0 and r.cached_tokens < max(len(toks), 1)
        # Cached positions must already hold exactly this prompt's tokens.
        for p in range(r.cached_tokens):
            assert self.kv.get(self._slot(sid, p)) == toks[p]
        self._write(sid, r.cached_tokens, toks[r.cached_tokens : r.num_stored])
        self.tokens[sid] = list(toks[: r.num_stored])
        self.reserved[sid] = 0

    @precondition(lambda self: self.tokens)
    @rule(
        data=st.data(),
        toks=st.lists(st.integers(0, 2), min_size=0, max_size=9),
        reserve=st.sampled_from([0, 0, 0, 1, 2, 5]),
    )
    def append(self, data, toks, reserve) -> None:
        """Values first fill the reserved slots (same positions), then new ones."""
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        if not toks and not reserve:
            return
        r = self._unchanged_on_failure(lambda: self.pool.append(sid, toks, reserve))
        if r is None:
            return
        self._copy(r.copies)
        self._write(sid, len(self.tokens[sid]), toks)
        self.tokens[sid].extend(toks)
        self.reserved[sid] += reserve - min(len(toks), self.reserved[sid])

    @precondition(lambda self: any(self.reserved.values()))
    @rule(data=st.data())
    def unreserve(self, data) -> None:
        """Give back some reserved slots: the blocks left holding none are
        free (never findable: the admit rule's cache check reads them)."""
        sid = data.draw(st.sampled_from(sorted(s for s, n in self.reserved.items() if n)))
        n = data.draw(st.integers(1, self.reserved[sid]))
        free_before = self.pool.num_free_blocks
        keep = self.pool.unreserve(sid, n)
        self.reserved[sid] -= n
        assert keep == len(self.pool.block_table(sid))
        held = len(self.tokens[sid]) + self.reserved[sid]
        assert keep == -(-held // self.B)
        assert self.pool.num_free_blocks >= free_before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.sampled_from([0, 1, 3]))
    def unreserve_too_many_fails_cleanly(self, data, extra) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self.pool.to_state()
        [r] = execute_step(self.pool, [Unreserve(sid, self.reserved[sid] + 1 + extra)])
        assert not r.ok and r.error == "invalid_argument"
        with pytest.raises(InvalidArgument):
            self.pool.unreserve(sid, 0)
        assert self.pool.to_state() == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        if self.reserved[parent]:  # refused: its reserved slots' values would never reach the child
            with pytest.raises(InvalidArgument):
                self.pool.fork(parent, child)
            return
        self.pool.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.reserved[child] = 0

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.free(sid)
        del self.tokens[sid], self.reserved[sid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), toks=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def step_with_free_first(self, data, toks) -> None:
        """A batched step: the free listed LAST still runs first."""
        victim = data.draw(st.sampled_from(sorted(self.tokens)))
        sid = self._new_id()
        results = execute_step(self.pool, [Admit(sid, toks), Free(victim)])
        assert results[1].ok
        del self.tokens[victim], self.reserved[victim]
        if results[0].ok:
            r = results[0]
            self._write(sid, r.cached_tokens, toks[r.cached_tokens :])
            self.tokens[sid] = list(toks)
            self.reserved[sid] = 0
        else:
            assert results[0].error == "out_of_blocks"

    @rule()
    def reset(self) -> None:
        self.pool.reset_prefix_cache()

    @rule(seq=st.sampled_from(["ghost", ""]))
    def bad_ops_fail_cleanly(self, seq) -> None:
        before = self.pool.to_state()
        results = execute_step(self.pool, [Append(seq, [1]), Free(seq), Fork(seq, "x")])
        assert [r.ok for r in results] == [False, False, False]
        assert self.pool.to_state() == before

    # -- invariants --------------------------------------------------------
    @invariant()
    def sound(self) -> None:
        if not hasattr(self, "B"):
            return
        assert self.pool.integrity_problems() == []
        for sid, toks in self.tokens.items():
            assert self.pool.num_tokens(sid) == len(toks) + self.reserved[sid]
            assert [self.kv.get(self._slot(sid, p)) for p in range(len(toks))] == toks
        st_ = self.pool.stats()
        assert st_.used_blocks + st_.free_blocks == self.pool.num_blocks


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pool_machine = PoolMachine.TestCase


@pytest.mark.parametrize("caching", [False, True])
def test_long_random_run(caching):
    """One long deterministic run (thousands of ops) at realistic shapes."""
    import random

    rng = random.Random(caching)
    pool = BlockPool(PoolConfig(64, 4, caching, "long"))
    live: dict[str, int] = {}
    ops = 0
    for i in range(4000):
        r = rng.random()
        if r < 0.3 or not live:
            n = rng.randint(0, 20)
            try:
                pool.admit(f"q{i}", [rng.randint(0, 3) for _ in range(n)])
                live[f"q{i}"] = n
            except OutOfBlocks:
                pass
        elif r < 0.75:
            sid = rng.choice(list(live))
            try:
                pool.append(sid, [rng.randint(0, 3)])
            except OutOfBlocks:
                pass
        elif r < 0.85:
            pool.fork(rng.choice(list(live)), f"f{i}")
            live[f"f{i}"] = 0
        else:
            pool.free(_pop(live, rng))
        ops += 1
        if i % 50 == 0:
            assert pool.integrity_problems() == []
    assert pool.integrity_problems() == []
    for sid in list(live):
        pool.free(sid)
    assert pool.stats().used_blocks == 0 and pool.check_integrity()


def _pop(live: dict[str, int], rng) -> str:
    sid = rng.choice(list(live))
    del live[sid]
    return sid
