"""A scheduler step: what the model computes (`StepBatch`)
and the plan it is made from (`StepPlan`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from allocator_service.core import Admit, Append, Fork, Free, Op, OpResult
from allocator_service.core.planner import AppendCost, PoolPlan
from allocator_service.core.tiers import Moves, TierReport
from worker.engine.sequence import Sequence


def priority_key(seq: Sequence) -> tuple[int, float]:
    """The scheduler's order: lower first; preemption picks the greatest."""
    return (seq.params.priority, seq.arrival_time)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_computed: int  # tokens already in the cache before this step
    num_new: int  # tokens whose K/V this step computes
    # The block table this step computes with: the list as scheduled (async
    # scheduling may preempt the sequence, which resets its table, while
    # planning the next step, before this step's forward pass runs).
    table: list[int]
    # This step computes the sequence's last token, so its logits give the
    # next one: decided when the step is planned (the token sampled by the
    # step before it may not be on the host yet when this one launches).
    samples: bool = False
    # of `num_computed`, the tokens its admission found cached (this step's admission)
    cached: int = 0


@dataclass(slots=True)
class StepBatch:
    entries: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # finished with an error by the allocator's answer
    failed: list[Sequence] = field(default_factory=list)
    allocator_seconds: float = 0.0
    # its operations went out in an allocator call (else computed in slots held)
    allocator_call: bool = False
    # prompt tokens this step's admissions did not compute (docs/architecture.md, "Counts")
    cached_tokens: int = 0
    queried_tokens: int = 0  # prompt tokens this step's admissions looked up
    # KV tiers (worker/engine/tiers.py): the answer's moves (None: no tier
    # moves), and swap mode's copies of preempted tails, (KV blocks, swap
    # slots) out and (swap slots, KV blocks) back in
    moves: Moves | None = None
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)

    @property
    def tiered(self) -> bool:
        """Whether computing it moves bytes between tiers."""
        return self.moves is not None or bool(self.swap_out) or bool(self.swap_in)

    def add_running(self, seq: Sequence, p: Planned) -> None:
        """A running sequence whose Append was accepted, or that needed none:
        this step computes its next `p.n` tokens with its table as it stands
        now, in slots it holds. None when its tokens were all computed (its
        last token is being sampled: it finishes with it)."""
        if p.n:
            self.entries.append(ScheduledSeq(seq, seq.num_stored, p.n, seq.block_table, p.samples))
        seq.num_stored += p.n
        if p.op is not None:
            seq.num_held, seq.num_reserved = p.held, p.reserved

    def add_finished(
        self, seq: Sequence, p: Planned | None, r: OpResult, start: int = 0, known: int = 0
    ) -> None:
        """An accepted operation of a sequence that finished (an abort) after
        its call was sent ahead: the tokens with known values it stored are
        computed all the same (the allocator may have hashed their blocks, so
        another sequence could find them: a findable block holds real K/V);
        what the step samples for it is dropped (`LLMEngine._run`)."""
        if r.keep or r.append:
            seq.block_table = [*seq.block_table[: r.keep], *r.append]
        self.copies.extend(r.copies)
        if p is not None:  # its Append (else an admission: `start`, `known`)
            start, known = seq.num_stored, p.known
            seq.num_stored += known
            seq.num_held, seq.num_reserved = p.held, p.reserved
        if known > 0:  # (nothing sampled: it would be dropped)
            self.entries.append(ScheduledSeq(seq, start, known, seq.block_table))


@dataclass(slots=True)
class Planned:
    """A running sequence's part of a step in the making."""

    n: int  # tokens this step computes
    cost: AppendCost  # what its Append takes from the pool (the view's answer)
    known: int  # of the `n` tokens, those whose values are known at planning
    must_call: bool  # it needs slots it does not hold (or a copy): the step makes a call
    samples: bool  # the `n` tokens reach its last one (counting the token the running step samples)
    op: Append | None = None  # None: computed in slots it holds, nothing sent for it
    held: int = 0  # after its Append: the slots it holds, ...
    reserved: int = 0  # ... the last of them without values


@dataclass(slots=True)
class Unreserved:
    """A running sequence that gives back its slots ahead in this call."""

    slots: int
    keep: int  # the table entries it keeps (the blocks past them are free)


@dataclass(slots=True)
class StepPlan:
    """One step in the making: the operations to send, and the pool as they leave it."""

    ops: list[Op]  # frees, forks, the last Appends of finished sequences; then the running
    view: PoolPlan  # the free blocks and refcounts once the operations planned so far are applied
    budget: int  # tokens left in this step
    running: dict[Sequence, Planned] = field(default_factory=dict)
    admitting: list[Sequence] = field(default_factory=list)
    admits: list[Admit] = field(default_factory=list)  # their ops, sent after the running Appends
    # blocks ran short (a preemption, a request left waiting): no lookahead blocks
    short: bool = False
    # blocks the first request left waiting for the token
    # budget takes next step: no lookahead takes them
    queued: int = 0
    # parents preempted after their samples forked in this call: their
    # blocks, held until their Free (next call)
    deferred: dict[str, list[int]] = field(default_factory=dict)
    # finished sequences and the Appends of their last values (sent after the forks)
    flushes: list[tuple[Sequence, Append]] = field(default_factory=list)
    forks: dict[Sequence, Fork] = field(default_factory=dict)  # child -> its Fork op
    # running sequences that give back their slots ahead in this call (so a
    # request is admitted, or nobody preempted)
    unreserves: dict[Sequence, Unreserved] = field(default_factory=dict)
    forked_parents: set[str] = field(default_factory=set)  # alloc ids forked from this step
    # async scheduling: sequences the running step samples a token for (one
    # more token each, its slot reserved)
    ahead: frozenset = frozenset()

    @property
    def free(self) -> int:
        """Blocks free for this step's appends and admits."""
        return self.view.free

    def free_first(self, seq: Sequence) -> None:
        """`seq` is freed first in this call: its blocks serve the step."""
        self.ops.insert(0, Free(seq.alloc_id))
        self.view.release(seq.block_table)


@dataclass(slots=True)
class InFlight:
    """A call sent ahead: its plan, the batch it fills, its answer to come."""

    plan: StepPlan
    batch: StepBatch
    future: Future
    report: TierReport | None = None  # the tier report it carries (given back if it is refused)
