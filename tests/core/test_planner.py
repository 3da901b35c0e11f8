"""Property-based (hypothesis) test of the planning view against the pool.

Random steps, each in the order a worker's scheduler sends them (frees,
forks, unreserves, at most one append per sequence, admits, some of them
reserving slots from admission), on pools tight
enough to run out, prefix caching on and off, KV tiers on and off (blocks
loaded from a tier are among an admission's hits, fresh blocks it takes). A `PoolPlan` is built from
what a caller learns from the answers (block tables, slots held and
reserved), as a scheduler builds it, and predicts each operation before
`BlockPool` applies it: the blocks it takes, copies on write or frees,
whether it runs out of blocks, the table and slot counts after it. Each
answer then feeds the plan (`hold`), so the whole step is predicted, and
after it the plan's free count and refcounts are the pool's own. The pool's
integrity checks stand for the rules the two share.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from allocator_service.core import BLOCK_STORED, BlockPool, InvalidArgument, OutOfBlocks, PoolConfig
from allocator_service.core.planner import PoolPlan, after_append, reserve_for
from allocator_service.core.tier_index import SharedStore

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=12)  # a tiny alphabet: shared prefixes


@dataclass
class Known:
    """A sequence as its caller knows it from the answers."""

    table: list[int]
    held: int  # slots the pool holds for it
    reserved: int  # the last of them without values


class PlannerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool
        self.seqs: dict[str, Known] = {}
        self.stored: list[int] = []  # blocks the pool hashed (BLOCK_STORED events)
        self.counter = 0

    @initialize(
        num_blocks=st.integers(1, 16),
        block_size=st.sampled_from([1, 2, 3, 4]),
        caching=st.booleans(),
        host_blocks=st.sampled_from([0, 0, 2, 8]),
        use_store=st.booleans(),
    )
    def setup(
        self, num_blocks: int, block_size: int, caching: bool, host_blocks: int, use_store: bool
    ) -> None:
        self.B = block_size
        self.caching = caching
        # KV tiers (with prefix caching): a tier hit takes a fresh block as a
        # miss does, so every prediction below holds unchanged.
        tiers = {
            "host_blocks": host_blocks,
            "layout": "L",
            "block_bytes": 1,
            "use_shared_store": use_store,
        }
        self.pool = BlockPool(
            PoolConfig(num_blocks, block_size, caching, "plan", **(tiers if caching else {})),
            lambda kind, b, h: self.stored.append(b) if kind == BLOCK_STORED else None,
            SharedStore(4),
        )

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    def _plan(self) -> PoolPlan:
        return PoolPlan(self.pool.num_blocks, self.B, (k.table for k in self.seqs.values()))

    def _apply(self, method, *args):
        """`method(*args)` on the pool: its answer, and how
        many blocks it freed (taken: negative)."""
        before = self.pool.num_free_blocks
        answer = method(*args)
        return answer, self.pool.num_free_blocks - before

    @rule(data=st.data())
    def step(self, data) -> None:
        plan = self._plan()
        assert plan.free == self.pool.num_free_blocks
        ids = sorted(self.seqs)
        # frees first
        for sid in (
            data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=2)) if ids else []
        ):
            predicted = plan.release(self.seqs.pop(sid).table)
            assert self._apply(self.pool.free, sid)[1] == predicted
        # forks: the child names every block of its parent, taking none
        ids = sorted(self.seqs)
        for parent in (
            data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=2)) if ids else []
        ):
            p, child = self.seqs[parent], self._new_id()
            if p.reserved:  # refused: the child would hold slots whose values only the parent sends
                with pytest.raises(InvalidArgument):
                    self.pool.fork(parent, child)
                continue
            plan.hold(p.table)
            table, freed = self._apply(self.pool.fork, parent, child)
            assert table == p.table and freed == 0
            self.seqs[child] = Known(list(table), p.held, 0)
        # unreserves: slots past the block that holds a chosen end
        for sid in sorted(s for s, k in self.seqs.items() if k.reserved):
            k = self.seqs[sid]
            end = data.draw(st.integers(k.held - k.reserved, k.held))
            slots, blocks = plan.unreserve(k.table, k.held, end)
            if not slots or not data.draw(st.booleans()):
                continue
            assert slots <= k.reserved
            keep = len(k.table) - blocks
            predicted = plan.release(k.table[keep:])
            assert predicted == blocks  # a block holding only reserved slots is private
            assert self._apply(self.pool.unreserve, sid, slots) == (keep, predicted)
            k.table, k.held, k.reserved = k.table[:keep], k.held - slots, k.reserved - slots
        # appends, at most one per sequence (a fork's child too)
        ids = sorted(self.seqs)
        for sid in data.draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []:
            self._append(plan, data, sid)
        # admissions
        for _ in range(data.draw(st.integers(0, 2))):
            self._admit(plan, data)
        assert plan.free == self.pool.num_free_blocks
        assert +plan.refs == Counter(self.pool.refcounts())
        # The worker applies the step's tier moves; its saves land by the next step.
        moves = self.pool.take_moves()
        self.pool.confirm(moves.host_saves[1::2], [], moves.store_saves)

    def _append(self, plan: PoolPlan, data, sid: str) -> None:
        k = self.seqs[sid]
        values = data.draw(st.lists(st.integers(0, 2), max_size=2 * self.B + 1))
        reserve = data.draw(st.sampled_from([0, 0, 1, 2, 5]))
        target, reserved = after_append(k.held, k.reserved, len(values), reserve)
        assert reserve_for(k.held, k.reserved, len(values), target) == reserve
        cost = plan.append(k.table, k.held, target)
        valued = k.held - k.reserved
        self.stored.clear()
        if cost.need > plan.free:
            with pytest.raises(OutOfBlocks):
                self.pool.append(sid, values, reserve)
            assert self.pool.block_table(sid) == k.table and self.pool.num_tokens(sid) == k.held
            return
        r, freed = self._apply(self.pool.append, sid, values, reserve)
        assert -freed == cost.need == len(r.new_blocks)
        assert r.copies == ([(cost.cow, r.new_blocks[0])] if cost.cow >= 0 else [])
        table = self.pool.block_table(sid)
        assert len(table) == cost.blocks and table[: r.keep] == k.table[: r.keep]
        assert self.pool.num_tokens(sid) == target
        if self.caching:  # a block whose last slot gets its value is hashed (findable)
            assert bool(self.stored) == plan.completes_block(valued, valued + len(values))
        plan.take(cost)
        plan.hold(r.new_blocks)
        k.table, k.held, k.reserved = table, target, reserved

    def _admit(self, plan: PoolPlan, data) -> None:
        tokens = data.draw(tokens_st)
        budget = data.draw(st.sampled_from([None, None, 1, 3]))
        # slots held from admission (a reservation)
        reserve = data.draw(st.sampled_from([0, 0, 1, 5]))
        most = plan.admit(len(tokens), reserve=reserve)
        sid = self._new_id()
        before = self.pool.num_free_blocks
        try:
            r = self.pool.admit(sid, tokens, None, budget, reserve)
        except OutOfBlocks:
            assert most > plan.free
            if not self.caching:  # nothing is found cached: exactly when the plan says
                assert plan.admit(len(tokens), budget, reserve=reserve) > plan.free
            assert self.pool.num_free_blocks == before
            return
        hits = r.table[: r.cached_tokens // self.B]
        assert not self.caching and not hits or self.caching
        taken = plan.admit(len(tokens), budget, hits, reserve)
        assert before - self.pool.num_free_blocks == taken <= most
        assert len(r.new_blocks) == len(r.table) - len(hits)
        assert len(r.table) == plan.blocks_for(r.num_stored + reserve)
        plan.take_blocks(taken)
        plan.hold(r.table)
        self.seqs[sid] = Known(list(r.table), r.num_stored + reserve, reserve)

    @invariant()
    def known_is_the_pool(self) -> None:
        if not hasattr(self, "B"):
            return
        assert self.pool.integrity_problems() == []
        state = self.pool.to_state()["seqs"]
        assert set(state) == set(self.seqs)
        for sid, k in self.seqs.items():
            assert self.pool.block_table(sid) == k.table
            assert self.pool.num_tokens(sid) == k.held
            assert state[sid].get("reserved", 0) == k.reserved
        plan = self._plan()
        assert plan.free == self.pool.num_free_blocks
        assert +plan.refs == Counter(self.pool.refcounts())


PlannerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_planner_machine = PlannerMachine.TestCase
