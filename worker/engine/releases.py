"""The sequences whose blocks go back to the allocator, from the moment the
scheduler lets them go until their Free is sent (`Releases`).

A sequence that finished (or was aborted) while running is freed in the next
call, or first sends the values of tokens it computed in steps that made no
call, when they fill a block (then it is `flushed` until a later call frees
it: frees run first in a call). Its blocks count as held until its Free goes
out. A parent whose samples fork in a call is freed by a later one. Frees of
a call the allocator refused go out again with the next call made for other
work. docs/architecture.md, "A request, end to end" (3).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

from allocator_service.core import Append, Free, Op
from worker.engine.sequence import Sequence
from worker.engine.step_plan import StepPlan

__all__ = ["Releases"]


class Releases:
    __slots__ = ("to_free", "finishing", "flushed", "free_later", "refused")

    def __init__(self) -> None:
        self.to_free: list[str] = []  # allocator ids whose Free leads the next call
        self.finishing: list[Sequence] = []  # finished while running: freed next call
        self.flushed: list[Sequence] = []  # sent their last values: freed by a later call
        # parents preempted in the call their samples fork in: freed next
        self.free_later: list[str] = []
        # Frees of a call the allocator refused: they ride the next call, but are
        # not work by themselves (an allocator that keeps refusing would
        # otherwise be called again at once, forever).
        self.refused: list[str] = []

    def held(self) -> Iterator[Sequence]:
        """The finished sequences whose blocks the allocator still holds."""
        return chain(self.finishing, self.flushed)

    def holds(self, seq: Sequence) -> bool:
        return seq in self.finishing or seq in self.flushed

    def holds_any(self) -> bool:
        return bool(self.finishing or self.flushed)

    def frees_due(self) -> bool:
        """Whether Frees wait to be sent (a call is needed for them)."""
        return bool(self.to_free or self.free_later or self.refused)

    def is_work(self) -> bool:
        """Whether the engine must step for them (refused Frees alone are not)."""
        return bool(self.to_free or self.free_later or self.finishing or self.flushed)

    def take_frees(self) -> list[Op]:
        """The Frees that lead the next call; they leave this record."""
        frees: list[Op] = [Free(a) for a in chain(self.to_free, self.free_later, self.refused)]
        self.to_free, self.free_later, self.refused = [], [], []
        return frees

    def plan_finishing(self, plan: StepPlan, parents: set, caching: bool) -> None:
        """Free the sequences that finished, in `plan`; one that computed
        tokens whose values the allocator lacks (steps that made no call)
        and that fill a block first sends them (the block is hashed, so
        findable as with a call per step; a partly filled block never is)
        and is freed by a later call. A parent in `parents` (its samples may
        fork in this call) is freed by a later one too."""
        keep: list[Sequence] = []
        for seq in self.flushed:
            if seq in parents:
                keep.append(seq)
            else:
                plan.free_first(seq)
        self.flushed = keep
        for seq in self.finishing:
            valued = seq.num_valued
            if seq in parents:
                self.flushed.append(seq)
            elif caching and plan.view.completes_block(valued, seq.num_stored):
                plan.flushes.append(
                    (seq, Append(seq.alloc_id, seq.token_ids[valued : seq.num_stored]))
                )
                self.flushed.append(seq)
            else:
                plan.free_first(seq)
        self.finishing = []

    def drop_flush(self, plan: StepPlan) -> bool:
        """Blocks ran short: free a finished sequence now instead of sending
        its last values first. Those only keep its blocks cached one more
        call; a call per step would have freed it in this one, so neither a
        preemption nor a request left waiting is worth them. Whether there
        was one."""
        if not plan.flushes:
            return False
        fseq, _ = plan.flushes.pop()
        self.flushed.remove(fseq)
        plan.free_first(fseq)
        return True

    def refuse(self, ops: Iterable[Op]) -> None:
        """The call carrying `ops` was refused: its Frees go out again."""
        self.refused.extend(op.seq for op in ops if isinstance(op, Free))

    def clear(self) -> None:
        """The pool is lost: nothing is left to free."""
        self.to_free, self.free_later, self.refused = [], [], []
        self.finishing, self.flushed = [], []
