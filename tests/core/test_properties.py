"""Property-based (hypothesis) test of the allocator core.

Thousands of random admit/append/fork/free/reset operations, prefix caching on
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
    OutOfBlocks,
    PoolConfig,
    execute_step,
)

# A tiny alphabet so that prompts often share prefixes and hit the cache.
tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=14)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool
        self.tokens: dict[str, list[int]] = {}
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
    @rule(toks=tokens_st, salt=st.sampled_from([None, None, "t1"]), budget=st.sampled_from([None, None, 1, 3]))
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

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), toks=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def append(self, data, toks) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        r = self._unchanged_on_failure(lambda: self.pool.append(sid, toks))
        if r is None:
            return
        self._copy(r.copies)
        self._write(sid, len(self.tokens[sid]), toks)
        self.tokens[sid].extend(toks)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.pool.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.free(sid)
        del self.tokens[sid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), toks=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def step_with_free_first(self, data, toks) -> None:
        """A batched step: the free listed LAST still runs first."""
        victim = data.draw(st.sampled_from(sorted(self.tokens)))
        sid = self._new_id()
        results = execute_step(self.pool, [Admit(sid, toks), Free(victim)])
        assert results[1].ok
        del self.tokens[victim]
        if results[0].ok:
            r = results[0]
            self._write(sid, r.cached_tokens, toks[r.cached_tokens:])
            self.tokens[sid] = list(toks)
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
            assert self.pool.num_tokens(sid) == len(toks)
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
