"""Continuous batching over the allocator: one Step call per engine step.

Each step sends, in ONE allocator call:
1. frees: sequences that finished or were aborted last step, and this step's
   preemption victims;
2. the running sequences in admission order, each with its next tokens: one
   for a decode, a chunk for an unfinished (chunked) prefill;
3. waiting requests admitted while the token budget, `max_num_seqs` (a
   request with n > 1 counts its n samples) and the free blocks allow, each
   storing at most the budget left past its cached prefix.

Parallel sampling (n > 1): the prompt is computed once, by sample 0. The step
that computes its last prompt token samples every sample's first token from
that one row of logits; the next step FORKS samples 1..n-1 from sample 0 in
the allocator (`Fork` ops, before any append of that step), so they share
every prompt block, and each sample's first append into the partly filled
last block copies it on write. A sample preempted later is recomputed alone
like any sequence (its prompt blocks found again in the prefix cache when it
is on); a parent that left before its samples could fork (preempted, pool
lost) leaves them to be admitted on their own: recompute, never wrong.

The worker plans the step against its own exact count of free blocks (the
pool is its own; cached free blocks count as free, being evictable) and
preempts BEFORE the call: the newest lowest-priority running sequence gives
its blocks back and is recomputed later (cheaply, from the prefix cache).

NOTE: planning up front is what keeps the prefix cache honest. The allocator
hashes a block as soon as it is full, and another sequence of the same step
may share it; so every operation the allocator accepts must be computed by
this step's forward pass. Dropping an accepted operation after the fact would
leave a findable block holding no K/V.

Async scheduling (the default; `--no-async-scheduling` turns it off): the
engine plans step N+1 and sends its call (`schedule_ahead`) before step N's
forward pass, and collects the answer (`schedule`) after step N sampled, so
the call runs while the model computes. A step's block needs depend on token
counts only: each sequence step N samples is planned one more token, whose
slot the call RESERVES (its value is being sampled); the value follows at
the front of the sequence's next Append, and only then can the block it
completes be hashed. Its K/V is written by step N+1's forward, and anything
that finds that block is admitted in call N+2 or later, so computes after
step N+1 (forwards run one after another): a findable block holds real K/V,
at step granularity as in the synchronous engine. A sequence that finished at
step N (stop token, length, stop string, abort) already holds a slot from
call N+1: its Free rides the next call, and the slot, never given a value, is
never hashed. The samples of a prompt are forked in the call planned before
the step that samples their first token, reserving that token's slot.
Preemption still happens while planning, before the call: a victim that is
part of step N keeps the token step N samples for it (recompute preemption).

Lookahead slots (`--num-lookahead-slots`, default 8, either mode): a call
holds each sequence it samples for that many slots past its next token
(reserved, as above), so the steps after it compute in slots held already and
make NO allocator call until a sequence runs out of them, new requests are
admitted, or a sample forks; a decode-only batch calls once per 1 + N steps.
The values of the tokens those steps computed ride the next call (so their
blocks are hashed up to N steps later). A finished sequence keeps its blocks
until a call goes out anyway (sooner when requests wait for room, or nothing
else runs); one with values not sent yet sends them in a last Append, and
its Free follows in the call after (frees run first in a call): the prefix
cache ends up with every block the sequence filled, as with a call per step.
Slots ahead are all or none: taken only when the free blocks hold every
sampling sequence's slots ahead, what every running one needs next and the
blocks of a request waiting only for the token budget (never by preempting;
never for a request's last token, which is sampled, not computed): near a
full pool every step calls again. A step short of blocks, for a running
sequence or the next request to admit, frees the finished sequences whose
last values were still to go out, then takes slots ahead back (`Unreserve`,
in the same call) before it preempts or leaves the request waiting: with
prefix caching off, slots ahead never cost an admission or a preemption
that a call per step would not (with it on, values hashed late can change
which blocks an admission finds). An allocator from before UNRESERVE (not in
its `op_kinds`) is sent none. The contract's rules and reasons:
docs/architecture.md, "The block contract".
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain

from allocator_service.client import (
    AllocatorClient,
    AllocatorUnavailable,
    EmbeddedAllocator,
    PoolLost,
)
from allocator_service.core import (
    UNRESERVE,
    Admit,
    Append,
    Fork,
    Free,
    Op,
    OpResult,
    StepResults,
    Unreserve,
    blocks_for,
)
from worker.engine.health import AllocatorError, AllocatorHealth
from worker.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_computed: int  # tokens already in the cache before this step
    num_new: int  # tokens whose K/V this step computes
    # The block table this step computes with: the list as scheduled (async
    # scheduling may preempt the sequence, which resets its table, while
    # planning the next step, before this step's forward pass runs).
    table: list[int]

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last known token, so its logits
        give the next one."""
        return self.num_computed + self.num_new == len(self.seq.token_ids)


@dataclass(slots=True)
class Batch:
    entries: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # finished with an error by the allocator's answer
    allocator_seconds: float = 0.0
    allocator_call: bool = False  # its operations went out in an allocator call (else computed in slots held)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache this step
    queried_tokens: int = 0


@dataclass(slots=True)
class _Planned:
    """A running sequence's part of a step in the making."""

    n: int  # tokens this step computes
    need: int  # blocks its Append takes from the free queue (a copy on write included)
    cow: int  # the shared block it copies on write, or -1
    known: int  # of the `n` tokens, those whose values are known at planning
    must_call: bool  # it needs slots it does not hold (or a copy): the step makes a call
    op: Append | None = None  # None: computed in slots it holds, nothing sent for it
    held: int = 0  # after its Append: the slots it holds, ...
    reserved: int = 0  # ... the last of them without values


@dataclass(slots=True)
class _StepPlan:
    """One step in the making: the operations to send and what they used up."""

    ops: list[Op]  # frees, forks, the last Appends of finished sequences; then the running
    refs: Counter  # block -> running sequences holding it
    free: int  # blocks free for this step's appends and admits
    budget: int  # tokens left in this step
    running: dict[Sequence, _Planned] = field(default_factory=dict)
    admitting: list[Sequence] = field(default_factory=list)
    admits: list[Admit] = field(default_factory=list)  # their ops, sent after the running Appends
    short: bool = False  # blocks ran short (a preemption, a request left waiting): no lookahead blocks
    # blocks the first request left waiting for the token budget takes next step: no lookahead takes them
    queued: int = 0
    # parents preempted after their samples forked in this call: their
    # blocks, held until their Free (next call)
    deferred: dict[str, list[int]] = field(default_factory=dict)
    # finished sequences and the Appends of their last values (sent after the forks)
    flushes: list[tuple[Sequence, Append]] = field(default_factory=list)
    forks: dict[Sequence, Fork] = field(default_factory=dict)  # child -> its Fork op
    # running sequences that give back their slots ahead in this call (so a
    # request is admitted, or nobody preempted): (slots, blocks that frees)
    unreserves: dict[Sequence, tuple[int, int]] = field(default_factory=dict)
    forked_parents: set[str] = field(default_factory=set)  # alloc ids forked from this step
    # async scheduling: sequences the running step samples a token for (one
    # more token each, its slot reserved: `_append_op`)
    ahead: frozenset = frozenset()


@dataclass(slots=True)
class _InFlight:
    """A call sent ahead: its plan, the batch it fills, its answer to come."""

    plan: _StepPlan
    batch: Batch
    future: Future


def _priority_key(seq: Sequence) -> tuple[int, float]:
    return (seq.params.priority, seq.arrival_time)


class Scheduler:
    def __init__(
        self,
        allocator: AllocatorClient,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_preempt: Callable[[Sequence, str], None] | None = None,
        async_scheduling: bool = False,
        lookahead: int = 0,
    ) -> None:
        self.allocator = allocator
        self.num_blocks = allocator.spec.config.num_blocks
        self.block_size = allocator.spec.config.block_size
        self.watermark = max(1, self.num_blocks // 100)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []  # admission order
        self._to_free: list[str] = []
        # Finished (or aborted) while running: each is freed, or first sends
        # the values of tokens it computed in steps that made no call
        # (`_flushed` until its Free is sent). Their blocks count as held
        # until then: they ride the next call (`_plan_finishing`).
        self._finishing: list[Sequence] = []
        self._flushed: list[Sequence] = []
        self._free_later: list[str] = []  # parents preempted in the call their samples fork in: freed next
        # Frees of a step the allocator refused: they ride the next call, but
        # are not work by themselves (an allocator that keeps refusing would
        # otherwise be called again at once, forever).
        self._refused_frees: list[str] = []
        self.forking: list[Sequence] = []  # samples that drew their first token, to fork next step
        self.on_preempt = on_preempt
        self.health = AllocatorHealth()
        self.async_scheduling = async_scheduling
        if lookahead < 0:
            raise ValueError("lookahead slots must be >= 0")
        self.lookahead = lookahead
        self.caching = allocator.spec.config.enable_prefix_caching
        self._inflight: _InFlight | None = None
        # A remote call waits on the network and the server: it runs on one
        # thread of its own while the forward pass runs. The embedded core is
        # pure Python that holds the GIL throughout, so a thread would only
        # interleave it with the forward pass: it runs inline, still planned
        # and applied a step ahead (the same rules, whichever client).
        self._executor: ThreadPoolExecutor | None = None
        if async_scheduling and not isinstance(allocator, EmbeddedAllocator):
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="allocator-call")

    # ---------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_priority_key)

    def add_fork(self, child: Sequence) -> None:
        """A sample that drew its first token from its parent's prompt logits:
        forked from the parent in the next step (unless a call planned ahead
        forked it already, or preempted it after: then it is admitted alone)."""
        if child.status is Status.RUNNING or child in self.waiting:
            child.fork_parent = None
            return
        self.forking.append(child)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished; its blocks are freed in the next step's call (after
        a last Append of values not sent yet: `_plan_finishing`)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._finishing.append(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.forking:
            self.forking.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def slots_ahead(self) -> int:
        """Token slots the allocator holds for this scheduler's sequences
        past what they computed: the slot of a token being sampled, lookahead
        slots, and those of finished sequences whose Free has not gone out."""
        return sum(seq.num_held - seq.num_stored for seq in chain(self.running, self._finishing, self._flushed))

    def has_work(self) -> bool:
        # NOTE: a call in flight that only frees, once answered, leaves nothing
        # to do: an idle engine need not step for it (the next `schedule`
        # collects it). Until answered it is work: the engine steps to collect
        # it, so nothing else (an idle probe) calls the client meanwhile; so
        # is a refused one, whose error must not fail the next request.
        inflight = self._inflight
        return bool(self.waiting or self.running or self._to_free or self.forking or self._free_later
                    or self._finishing or self._flushed
                    or (inflight and (not inflight.future.done() or inflight.future.exception() is not None
                                      or inflight.plan.running or inflight.plan.admitting or inflight.plan.forks)))

    # ------------------------------------------------------------------ step
    def schedule(self) -> Batch:
        """The step to compute now: the answer of the call sent ahead, or
        (none in flight) the step planned, sent in one allocator call and
        answered now."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._collect(inflight)
            return inflight.batch
        batch = Batch()
        plan = self._plan(batch, frozenset())
        if not plan.ops:  # nothing to send: computed in slots held already
            self._apply_results(plan, [], batch)
            return batch
        batch.allocator_call = True
        results = self._call(plan.ops, batch)
        if results is not None:
            self._apply_results(plan, results, batch)
        return batch

    def schedule_ahead(self, running: Batch) -> bool:
        """Async scheduling: plan the step after `running` (about to be
        computed) as if each sequence it samples has one more token, and send
        its call; `schedule` collects the answer after `running` sampled.
        Whether a call was sent (a step with nothing to do sends none).
        A sequence (or unforked sample) whose draw is its last (`max_tokens`)
        finishes with it: nothing is planned for that token, which is never
        computed (a sample finished so is never forked, as in the
        synchronous engine)."""
        sampling = [e.seq for e in running.entries if e.samples]
        sampling += [c for s in sampling for c in s.unforked_samples()]
        ahead = [s for s in sampling if len(s.token_ids) < s.max_computed_tokens]
        batch = Batch()
        plan = self._plan(batch, frozenset(ahead))
        if not plan.ops:  # nothing to send: computed in slots held already
            future: Future = Future()
            future.set_result([])
            self._inflight = _InFlight(plan, batch, future)
            return False
        batch.allocator_call = True
        t0 = time.perf_counter()
        if self._executor is None:
            future = Future()
            try:
                future.set_result(self._send(plan.ops))
            except BaseException as exc:  # noqa: BLE001 - raised where the answer is collected
                future.set_exception(exc)
        else:
            future = self._executor.submit(self._send, plan.ops)
        batch.allocator_seconds += time.perf_counter() - t0
        self._inflight = _InFlight(plan, batch, future)
        return True

    def _collect(self, inflight: _InFlight) -> None:
        """Wait for a call sent ahead and apply its answer (the time waited is
        what the step pays for the allocator)."""
        batch = inflight.batch
        results = self._received(lambda: inflight.future.result(), batch, inflight.plan.ops)
        if results is not None:
            self._apply_results(inflight.plan, results, batch)

    def close(self) -> None:
        """Wait for a call in flight (its answer is dropped) and stop the call thread."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            try:
                inflight.future.result()
            except Exception:  # noqa: BLE001, S110 - closing: nothing more to compute
                pass
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _plan(self, batch: Batch, ahead: frozenset) -> _StepPlan:
        """One step's operations, against the exact count of free blocks."""
        call = self._call_needed(ahead)
        # (a parent freed after the forks of the last call: first in this one)
        plan = _StepPlan(ops=[Free(a) for a in chain(self._to_free, self._free_later, self._refused_frees)],
                         refs=Counter(), free=0, budget=self.max_num_batched_tokens, ahead=ahead)
        self._to_free = []
        self._free_later = []
        self._refused_frees = []
        if call:  # finished sequences ride it: freed first, so their blocks serve this step
            self._plan_finishing(plan, ahead)
        # NOTE: chain, not a generator: the count runs over every block the
        # running sequences hold, at C speed (30 -> 20 us for ~1,000 blocks).
        # Finished sequences hold their blocks until their Free is sent.
        holders = chain(self.running, self._finishing, self._flushed)
        plan.refs.update(chain.from_iterable(seq.block_table for seq in holders))
        plan.free = self.num_blocks - len(plan.refs)
        self._plan_forks(plan, self.forking)
        self.forking = []
        if ahead:  # the samples the running step draws a first token for: forked before it
            self._plan_forks(plan, [c for c in ahead if c.fork_parent is not None])
        self._plan_running(plan, batch)
        if batch.preempted:
            plan.short = True
        else:
            self._plan_admissions(plan)
        if call or plan.ops or plan.admits or any(p.must_call for p in plan.running.values()):
            self._plan_appends(plan)
        return plan

    def _call_needed(self, ahead: frozenset) -> bool:
        """Whether this step makes an allocator call: a running sequence needs
        slots it does not hold, a sample forks, or something waits to be
        freed. Finished sequences alone make one only when requests wait for
        room or nothing else runs (else they ride the next call). Admissions
        make one too (`_plan`); they wait only while requests do."""
        if (self._to_free or self._free_later or self._refused_frees or self.forking
                or any(c.fork_parent is not None for c in ahead)):
            return True
        if (self._finishing or self._flushed) and (self.waiting or not self.running):
            return True
        return any(len(seq.token_ids) + (seq in ahead) > seq.num_held for seq in self.running)

    def _plan_finishing(self, plan: _StepPlan, ahead: frozenset) -> None:
        """Free the sequences that finished; one that computed tokens whose
        values the allocator lacks (steps that made no call) and that fill a
        block first sends them (the block is hashed, so findable as with a
        call per step; a partly filled block never is) and is freed by a
        later call: frees run first in a call. A parent whose samples may
        fork in this call is freed by a later one too."""
        parents = {c.fork_parent for c in chain(self.forking, ahead) if c.fork_parent is not None}
        keep: list[Sequence] = []
        for seq in self._flushed:
            if seq in parents:
                keep.append(seq)
            else:
                plan.ops.insert(0, Free(seq.alloc_id))
        self._flushed = keep
        for seq in self._finishing:
            valued = seq.num_valued
            if seq in parents:
                self._flushed.append(seq)
            elif self.caching and seq.num_stored // self.block_size > valued // self.block_size:
                plan.flushes.append((seq, Append(seq.alloc_id, seq.token_ids[valued : seq.num_stored])))
                self._flushed.append(seq)
            else:
                plan.ops.insert(0, Free(seq.alloc_id))
        self._finishing = []

    def _plan_forks(self, plan: _StepPlan, children: list[Sequence]) -> None:
        """Fork samples from their parent, which then holds exactly the
        prompt: those that drew their first token last step, and (async)
        those the running step draws it for (`plan.ahead`: their
        `fork_parent` stays until it is drawn, which the model runner reads).
        A parent that finished last step is freed one step later, after the
        forks; one no longer in the allocator leaves its samples to be
        admitted on their own."""
        if not children:
            return
        for child in children:
            parent = child.fork_parent
            predicted = child in plan.ahead
            if not predicted:
                child.fork_parent = None
            # (a finished parent is kept until its samples forked: `_plan_finishing`)
            alive = parent is not None and (parent.status is Status.RUNNING or parent in self._finishing
                                            or parent in self._flushed)
            if (not alive or parent.num_stored != child.num_prompt_tokens or parent.num_held != parent.num_stored
                    or parent.num_reserved):
                if not predicted:
                    self.add(child)  # recompute: admitted like any request
                # else: left to its first token (`add_fork` then)
                continue
            op = Fork(parent.alloc_id, child.next_alloc_id())
            plan.ops.append(op)
            plan.forks[child] = op
            plan.forked_parents.add(parent.alloc_id)
            child.status = Status.RUNNING
            child.block_table = list(parent.block_table)
            child.num_stored = child.num_held = parent.num_stored
            child.num_reserved = 0
            child.admitted_once = True
            child.num_cached_tokens = parent.num_cached_tokens
            plan.refs.update(child.block_table)
            # right after its parent: preempted in the same order as it
            at = self.running.index(parent) + 1 if parent in self.running else len(self.running)
            self.running.insert(at, child)

    def _plan_running(self, plan: _StepPlan, batch: Batch) -> None:
        """Give each running sequence its next tokens while the budget lasts,
        preempting the lowest-priority ones when blocks run short."""
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted as a victim earlier in this loop
            if plan.budget <= 0:
                break
            n = min(len(seq.token_ids) + (seq in plan.ahead) - seq.num_stored, plan.budget)
            end = seq.num_stored + n
            while True:
                # A write into a partly filled block others share copies it
                # first (the allocator applies the appends in this order).
                cow = -1
                if seq.num_held % self.block_size and plan.refs[seq.block_table[-1]] > 1:
                    cow = seq.block_table[-1]
                need = self._blocks_needed(seq, n) + (cow >= 0)
                if need <= plan.free:
                    break
                if self._drop_flush(plan):
                    continue
                if self._unreserve_ahead(plan, need - plan.free):
                    continue  # other sequences' slots ahead made the room
                victim = max(self.running, key=_priority_key)
                if victim in plan.running:  # give back what it was promised
                    given = plan.running.pop(victim)
                    plan.budget += given.n
                    plan.free += given.need
                    if given.cow >= 0:  # it holds the shared block again until its free
                        plan.refs[given.cow] += 1
                plan.free += self._preempt(batch, victim, plan.refs, plan.ops, "out_of_blocks", plan)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            if cow >= 0:
                plan.refs[cow] -= 1  # the shared block loses this holder
            known = max(0, min(end, len(seq.token_ids)) - seq.num_stored)
            plan.running[seq] = _Planned(n, need, cow, known, end > seq.num_held or cow >= 0)
            plan.free -= need
            plan.budget -= n

    def _plan_appends(self, plan: _StepPlan) -> None:
        """The step makes a call: every running sequence sends the values it
        has not sent, and each one that samples tops its slots up to
        `lookahead` past its next token; then the admissions follow.
        Lookahead is all or none: only when the free blocks past the
        watermark hold every running sequence's lookahead and what each still
        needs for its known tokens and its next one (so a sequence that gets
        none now is not starved by those that did over the next steps), and
        never in a step that preempted or left a request waiting for blocks.
        Otherwise a sequence takes only the room of the blocks it takes anyway."""
        plan.ops.extend(op for _, op in plan.flushes)
        # (before the Appends: the blocks they free may serve them)
        plan.ops.extend(Unreserve(seq.alloc_id, slots) for seq, (slots, _) in plan.unreserves.items())
        B = self.block_size
        wants: dict[Sequence, tuple[int, int]] = {}  # sampling sequence -> (slots it wants, blocks it holds then)
        for seq, p in plan.running.items():
            end = seq.num_stored + p.n
            # (not while samples wait to fork from it: a parent forks holding
            # exactly its prompt)
            if (self.lookahead and end >= len(seq.token_ids)  # this step samples it
                    and seq not in plan.unreserves
                    and not any(c.fork_parent is seq and not c.is_finished for c in seq.children)):
                # never past what the request can still compute
                wants[seq] = (min(end + self.lookahead, seq.max_computed_tokens), self._blocks_after(seq, p))
        extra_total = sum(max(0, blocks_for(want, B) - blocks) for want, blocks in wants.values())
        fits = bool(wants) and not plan.short and extra_total <= (
            plan.free - self.watermark - self._blocks_to_come(plan) - plan.queued)
        for seq, p in plan.running.items():
            end = seq.num_stored + p.n
            if seq in plan.unreserves:
                # It keeps the blocks up to `end` (`_unreserve_ahead`): its
                # Append, after the Unreserve, sends values only, into slots
                # it keeps (built against what it holds now: it reserves none).
                target = seq.num_held - plan.unreserves[seq][0]
                op = _append_op(seq, end, seq.num_held)
            else:
                target = max(end, seq.num_held)
                if seq in wants:
                    want, blocks = wants[seq]
                    if fits:
                        extra = max(0, blocks_for(want, B) - blocks)
                        p.need += extra
                        plan.free -= extra
                        target = max(target, want)
                    else:
                        target = max(target, min(want, blocks * B))
                op = _append_op(seq, end, target)
            if op.tokens or target > seq.num_held:
                p.op = op
                p.held = target
                p.reserved = target - seq.num_valued - len(op.tokens)
                plan.ops.append(op)
        plan.ops.extend(plan.admits)

    @staticmethod
    def _blocks_after(seq: Sequence, p: _Planned) -> int:
        """The blocks `seq` holds once its planned Append is applied."""
        return len(seq.block_table) + p.need - (p.cow >= 0)

    def _blocks_to_come(self, plan: _StepPlan) -> int:
        """Blocks the running sequences need after this step for what they
        will compute: their known tokens not computed yet (the rest of a
        chunked prompt, a recompute) and the next token; at least one each.
        Lookahead leaves these free."""
        B, total = self.block_size, 0
        for seq in self.running:
            p = plan.running.get(seq)
            blocks = self._blocks_after(seq, p) if p is not None else len(seq.block_table)
            total += max(1, blocks_for(len(seq.token_ids) + 1, B) - blocks)
        return total

    def _drop_flush(self, plan: _StepPlan) -> bool:
        """Blocks ran short: free a finished sequence now instead of sending
        its last values first. Those only keep its blocks cached one more
        call; a call per step would have freed it in this one, so neither a
        preemption nor a request left waiting is worth them. Whether there
        was one."""
        if not plan.flushes:
            return False
        fseq, _ = plan.flushes.pop()
        self._flushed.remove(fseq)
        plan.ops.insert(0, Free(fseq.alloc_id))
        plan.free += _release(plan.refs, fseq.block_table)
        return True

    def _unreserve_ahead(self, plan: _StepPlan, short: int) -> bool:
        """Make `short` more blocks free by giving back the slots running
        sequences hold past anything this step computes (lookahead slots):
        whole trailing blocks, the newest lowest-priority sequences' first,
        as preemption would pick them. All or nothing: whether that made the
        room (else nothing is given back). A sequence gives back the blocks
        past the one that holds the end of this step's tokens (for one not
        planned yet, of its known tokens and the one being sampled), and
        keeps any room in that block; what it gives back is reserved slots
        (past anything computed, so without values)."""
        if not self.lookahead or UNRESERVE not in self.allocator.op_kinds:
            return False  # no slots ahead, or an allocator from before UNRESERVE
        B, found, picked = self.block_size, 0, []
        for seq in sorted(self.running, key=_priority_key, reverse=True):
            if found >= short:
                break
            if seq in plan.unreserves:
                continue
            p = plan.running.get(seq)
            end = seq.num_stored + p.n if p is not None else len(seq.token_ids) + (seq in plan.ahead)
            keep = blocks_for(end, B)
            blocks = len(seq.block_table) - keep
            if blocks > 0:
                picked.append((seq, seq.num_held - keep * B, blocks))
                found += blocks
        if found < short:
            return False
        for seq, slots, blocks in picked:
            plan.unreserves[seq] = (slots, blocks)
        plan.free += found
        plan.short = True  # blocks ran short: this step takes no lookahead back
        return True

    def _plan_admissions(self, plan: _StepPlan) -> None:
        """Admit waiting requests while the budget, `max_num_seqs` and the free blocks allow."""
        # Keep a little headroom for the running sequences' next blocks, so a
        # new admission does not force a preemption on the very next step.
        headroom = self.watermark if self.running else 0
        seqs = len(self.running)
        for seq in self.waiting:
            # A request's samples are forked from it once its prompt is
            # computed: they count from its admission (n <= max_num_seqs,
            # checked at add_request, so a family alone always fits).
            family = 1 + sum(1 for c in seq.children if c.fork_parent is seq and not c.is_finished)
            if seqs + family > self.max_num_seqs:
                break
            # Upper bound of the blocks an admit takes from the free queue
            # (cache hits on free blocks leave the queue too).
            worst = blocks_for(len(seq.token_ids), self.block_size)
            if plan.budget <= 0:  # admitted next step, if its blocks are still free
                plan.queued = worst
                break
            while worst > plan.free - headroom and self._drop_flush(plan):
                pass
            if worst > plan.free - headroom and not self._unreserve_ahead(plan, worst - plan.free + headroom):
                plan.short = True
                break
            plan.admits.append(Admit(seq.next_alloc_id(), seq.token_ids, seq.cache_salt, plan.budget))
            plan.admitting.append(seq)
            seqs += family
            plan.free -= worst
            plan.budget -= min(len(seq.token_ids), plan.budget)

    def _apply_results(self, plan: _StepPlan, results: StepResults | list[OpResult], batch: Batch) -> None:
        """Apply the allocator's answers: block tables, copies, admissions, refusals."""
        # `ops`: frees, forks, the finished's last Appends, unreserves, the running's Appends, admits
        ri = len(plan.ops) - len(plan.forks) - len(plan.flushes) - len(plan.unreserves) - len(plan.admitting)
        ri -= sum(1 for p in plan.running.values() if p.op is not None)
        for child in plan.forks:
            r = results[ri]
            ri += 1
            if r.ok:  # (one finished while the call was out is in `_finishing` already)
                child.block_table = list(r.append)
            # else: its append fails too (unknown sequence), which sends it back to wait
        for seq, op in plan.flushes:  # values of slots held: no table change
            if results[ri].ok:
                seq.num_reserved -= len(op.tokens)
            ri += 1
        for seq, (slots, _) in plan.unreserves.items():
            r = results[ri]
            ri += 1
            if r.ok:  # (a new list: the step in flight keeps the table it was scheduled with)
                seq.block_table = seq.block_table[: r.keep]
                seq.num_held -= slots
                seq.num_reserved -= slots
            elif (p := plan.running.get(seq)) is not None and p.op is not None:
                # Refused (should not happen): nothing changed, it still
                # holds them; its Append sent values only, which stands.
                p.held += slots
                p.reserved += slots
        # NOTE: a decode step's appends mostly leave the table as it is (no
        # error, no new block, no copy): read those from the result columns
        # without making an OpResult each (`StepResults`).
        cols = results.columns if isinstance(results, StepResults) else None
        for seq, p in plan.running.items():
            if p.op is None:  # computed in slots it holds: no call for it
                if not seq.is_finished:  # (finished since: nothing sent, nothing to compute)
                    self._computes(batch, seq, p)
                continue
            if (cols is not None and not seq.is_finished and not cols.errors[ri] and not cols.num_appended[ri]
                    and not cols.num_copies[ri] and cols.keep[ri] == len(seq.block_table)):
                self._computes(batch, seq, p)
                ri += 1
                continue
            r = results[ri]
            ri += 1
            if seq.is_finished:
                # Finished after the call was sent (async): its Free is queued;
                # a slot reserved for it is never given a value, so never hashed.
                if r.ok:
                    self._finished_answer(batch, seq, p, r)
                continue
            if r.ok:
                seq.block_table[r.keep :] = r.append
                batch.copies.extend(r.copies)
                self._computes(batch, seq, p)
            else:
                # Our free-block count was off (should not happen) or the
                # allocator lost the sequence: the failed op changed nothing,
                # so recompute this one from scratch.
                self._preempt(batch, seq, None, None, r.error or "allocator_error")
                if r.error != "unknown_sequence":
                    self._to_free.append(seq.alloc_id)
        for seq in plan.admitting:
            r = results[ri]
            ri += 1
            if seq.is_finished:  # aborted while the call was out (async)
                if r.ok:  # admitted all the same: computed now, freed next step
                    self._to_free.append(seq.alloc_id)
                    seq.block_table = list(r.append)
                    self._finished_answer(batch, seq, None, r, r.cached_tokens, r.num_stored - r.cached_tokens)
            elif r.ok:
                self._admitted(batch, seq, r)
            elif r.error != "out_of_blocks":
                # Refused for good (e.g. invalid): waiting would wait forever.
                seq.error = f"the allocator refused the request: {r.message or r.error}"
                self.finish(seq, "error")
                batch.failed.append(seq)

    def _finished_answer(self, batch: Batch, seq: Sequence, p: _Planned | None, r: OpResult,
                         start: int = 0, known: int = 0) -> None:
        """An accepted operation of a sequence that finished (an abort) after
        its call was sent ahead: the tokens with known values it stored are
        computed all the same (the allocator may have hashed their blocks, so
        another sequence could find them: a findable block holds real K/V);
        what the step samples for it is dropped (`LLMEngine._run`)."""
        if r.keep or r.append:
            seq.block_table[r.keep :] = r.append
        batch.copies.extend(r.copies)
        if p is not None:  # its Append (else an admission: `start`, `known`)
            start, known = seq.num_stored, p.known
            seq.num_stored += known
            seq.num_held, seq.num_reserved = p.held, p.reserved
        if known > 0:
            batch.entries.append(ScheduledSeq(seq, start, known, seq.block_table))

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        return max(0, blocks_for(seq.num_stored + n, self.block_size) - len(seq.block_table))

    # ------------------------------------------------------------- internals
    # A step the allocator did not answer (AllocatorUnavailable: down,
    # restarting, its Redis away) is sent again, the SAME operations, after
    # pauses doubling from the first to the second value, until it is
    # answered: the plan of this step is made (preemptions, admissions), and
    # the client reuses the step id, so the server applies it exactly once.
    # `on_stall(seconds)` is told each pause. `health` is told whether each
    # call was answered; any other error from the allocator is a refusal: it
    # becomes AllocatorError (the step fails, nothing was applied).
    stall_backoff_s: tuple[float, float] = (0.05, 1.0)
    on_stall: Callable[[float], None] | None = None

    def _call(self, ops: list[Op], batch: Batch):
        return self._received(lambda: self._send(ops), batch, ops)

    def _send(self, ops: list[Op]) -> list[OpResult]:
        """Send the step until it is answered (on the call thread, with async
        scheduling and a remote allocator)."""
        pause = self.stall_backoff_s[0]
        health = self.health
        while True:
            health.call_started()
            try:
                results = self.allocator.step(ops)
            except AllocatorUnavailable:
                health.unanswered()
                time.sleep(pause)
                if self.on_stall is not None:
                    self.on_stall(pause)
                pause = min(pause * 2, self.stall_backoff_s[1])
                continue
            health.answered()
            return results

    def _received(self, answer: Callable[[], list[OpResult]], batch: Batch, ops: list[Op]):
        """The step's answer to `ops`, or None when the pool was lost (every
        running sequence is then preempted); a refusal becomes AllocatorError.
        A refused step applied nothing, so its Frees (sequences finished or
        preempted, which the scheduler no longer tracks) go out again with
        the next call made for other work: else the allocator would keep
        their blocks for as long as the worker renews its lease."""
        t0 = time.perf_counter()
        health = self.health
        try:
            return answer()
        except PoolLost:
            # Every block is gone: all running sequences start over.
            health.answered()  # the client registered a fresh pool
            for seq in list(self.running):
                self._preempt(batch, seq, None, None, "pool_lost")
            self._to_free = []
            self._free_later = []
            self._refused_frees = []
            self._finishing = []
            self._flushed = []
            return None
        except Exception as exc:
            health.refused(exc)
            self._refused_frees.extend(op.seq for op in ops if isinstance(op, Free))
            raise AllocatorError("allocator_refused", "the allocator refused this worker's step") from exc
        finally:
            batch.allocator_seconds += time.perf_counter() - t0

    def _computes(self, batch: Batch, seq: Sequence, p: _Planned) -> None:
        """A running sequence whose Append was accepted, or that needed none:
        this step computes its next `p.n` tokens with its table as it stands
        now, in slots it holds."""
        batch.entries.append(ScheduledSeq(seq, seq.num_stored, p.n, seq.block_table))
        seq.num_stored += p.n
        if p.op is not None:
            seq.num_held, seq.num_reserved = p.held, p.reserved

    def _admitted(self, batch: Batch, seq: Sequence, r: OpResult) -> None:
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = Status.RUNNING
        seq.block_table = list(r.append)
        seq.num_stored = seq.num_held = r.num_stored
        seq.num_reserved = 0
        if not seq.admitted_once:
            seq.num_cached_tokens = r.cached_tokens
            seq.admitted_once = True
        batch.cached_tokens += r.cached_tokens
        batch.queried_tokens += len(seq.token_ids)
        batch.entries.append(ScheduledSeq(seq, r.cached_tokens, r.num_stored - r.cached_tokens, seq.block_table))

    def _preempt(self, batch: Batch, seq: Sequence, refs: Counter | None, ops: list[Op] | None, cause: str,
                 plan: _StepPlan | None = None) -> int:
        """Send `seq` back to the waiting queue. With `ops`, its Free joins
        this step; returns the blocks that frees (those no other sequence holds)."""
        # A parent its samples fork from in this call keeps its blocks until
        # its Free, in the next call (frees run first in a call).
        deferred = plan is not None and seq.alloc_id in plan.forked_parents and seq not in plan.forks
        freed = 0 if refs is None or deferred else _release(refs, seq.block_table)
        if plan is not None and seq in plan.unreserves:  # (those blocks were counted free already)
            freed -= plan.unreserves.pop(seq)[1]
        if plan is not None and seq in plan.forks:  # forked this step: just do not fork it
            fork = plan.forks.pop(seq)
            ops.remove(fork)
            if all(f.parent != fork.parent for f in plan.forks.values()):  # nothing forks from it now
                plan.forked_parents.discard(fork.parent)
                if fork.parent in self._free_later:  # preempted: free it now
                    self._free_later.remove(fork.parent)
                    ops.insert(0, Free(fork.parent))
                    plan.free += _release(refs, plan.deferred.pop(fork.parent))
        elif deferred:
            self._free_later.append(seq.alloc_id)
            plan.deferred[seq.alloc_id] = list(seq.block_table)
        elif ops is not None:
            ops.insert(0, Free(seq.alloc_id))
        self.running.remove(seq)
        seq.reset_for_recompute()
        self.add(seq)
        batch.preempted.append(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq, cause)
        return freed


def _release(refs: Counter, table: list[int]) -> int:
    """Drop one holder of each block of `table`; the blocks no one holds now."""
    freed = 0
    for b in table:
        refs[b] -= 1
        if refs[b] == 0:
            del refs[b]
            freed += 1
    return freed


def _append_op(seq: Sequence, end: int, target: int) -> Append:
    """The Append that makes `seq` hold `target` slots (>= `end`, the end of
    what this step computes, and >= those it holds): first the values of the
    slots it holds without them (reserved before, or computed by steps that
    made no call), then those of the new slots up to `end` whose tokens are
    known (no value past what is computed by the end of this step: a block
    is findable once its values are in), and a reservation for the rest (the
    token the running step samples for it, with async scheduling, and the
    lookahead slots)."""
    start = seq.num_valued
    tokens = seq.token_ids[start : min(end, len(seq.token_ids))]
    fill = min(len(tokens), seq.num_reserved)  # values of slots it holds
    return Append(seq.alloc_id, tokens, target - seq.num_held - (len(tokens) - fill))
