"""Continuous batching over the allocator: one Step call per engine step.

`Scheduler` owns order and policy (who runs, is admitted, waits, is
preempted) and every write to its queues, answers applied included. What an
operation takes or frees is asked of the core's planning view (`PoolPlan`).
A call carries, in order: frees (finished, aborted, this step's victims);
forks of parallel samples; the running sequences in admission order, each
with its next tokens; then admissions while the token budget, `max_num_seqs`
and the free blocks allow. Preemption (newest lowest-priority first) is
planned BEFORE the call, so the step computes every operation the allocator
accepts. `schedule_ahead` plans step N+1 while step N computes (async).
Slots ahead: lookahead.py; the call: step_calls.py; frees: releases.py.
Reasons: docs/architecture.md, "A request, end to end" (3), "The block contract".
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from concurrent.futures import Future
from itertools import chain

from allocator_service.client import OUT_OF_BLOCKS, UNKNOWN_SEQUENCE, AllocatorClient, PoolLost
from allocator_service.core import UNRESERVE, Admit, Fork, Free, Op, OpResult, StepAnswer
from allocator_service.core.planner import PoolPlan, after_append, after_unreserve
from allocator_service.core.tiers import TierReport
from worker.engine.health import AllocatorFault
from worker.engine.lookahead import plan_appends, unreserve_ahead
from worker.engine.releases import Releases
from worker.engine.reservation import reserved_slots
from worker.engine.sequence import Sequence, Status
from worker.engine.step_calls import Answer, StepCalls
from worker.engine.step_plan import (
    InFlight,
    Planned,
    ScheduledSeq,
    StepBatch,
    StepPlan,
    priority_key,
)
from worker.engine.tiers import EngineTiers

__all__ = ["StepBatch", "ScheduledSeq", "Scheduler"]


class Scheduler:
    def __init__(
        self,
        allocator: AllocatorClient,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_preempt: Callable[[Sequence, str], None] | None = None,
        async_scheduling: bool = False,
        lookahead: int = 0,
        reservation: str = "paged",
        most_slots: int = 0,
    ) -> None:
        self.allocator = allocator
        self.num_blocks = allocator.spec.config.num_blocks
        self.block_size = allocator.spec.config.block_size
        # blocks kept free for the running sequences' next ones (admissions, lookahead)
        self.watermark = max(1, self.num_blocks // 100)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []  # admission order
        self.releases = Releases()  # sequences let go, until their Free is sent
        self.forking: list[Sequence] = []  # samples that drew their first token, to fork next step
        self.on_preempt = on_preempt
        self.calls = StepCalls(allocator, ahead=async_scheduling)  # each sent until answered
        self.async_scheduling = async_scheduling
        if lookahead < 0:
            raise ValueError("lookahead slots must be >= 0")
        self.lookahead = lookahead
        # Slots a request holds from its admission (reservation.py); `most_slots`:
        # the most a sequence can hold (the context length, or the pool when smaller).
        self.reservation = reservation
        self.most_slots = most_slots
        self.caching = allocator.spec.config.enable_prefix_caching
        self.tiers: EngineTiers | None = None  # the KV tiers below the pool (set by the engine)
        self._inflight: InFlight | None = None

    # ---------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=priority_key)

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
        a last Append of values not sent yet: `Releases.plan_finishing`)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.releases.finishing.append(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.forking:
            self.forking.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq.swap is not None:
            self.tiers.drop_swap(seq)  # type: ignore[union-attr]

    def slots_ahead(self) -> int:
        """Token slots the allocator holds for this scheduler's sequences
        past what they computed: the slot of a token being sampled, lookahead
        slots, and those of finished sequences whose Free has not gone out."""
        return sum(
            seq.num_held - seq.num_stored for seq in chain(self.running, self.releases.held())
        )

    def has_work(self) -> bool:
        # NOTE: a call in flight that only frees leaves nothing to do once
        # answered (the next `schedule` collects it). Until answered it is work:
        # the engine steps to collect it, so nothing else (an idle probe) calls
        # the client meanwhile; so is a refused one, whose error must not fail
        # the next request. A tier report due is work too: a step sends it alone.
        inflight = self._inflight
        return bool(
            self.waiting
            or self.running
            or self.forking
            or self.releases.is_work()
            or self._report_due()
            or (
                inflight
                and (
                    not inflight.future.done()
                    or inflight.future.exception() is not None
                    or inflight.plan.running
                    or inflight.plan.admitting
                    or inflight.plan.forks
                )
            )
        )

    # ------------------------------------------------------------------ step
    def schedule(self) -> StepBatch:
        """The step to compute now: the answer of the call sent ahead, or
        (none in flight) the step planned, sent in one allocator call and
        answered now."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._collect(inflight)
            return inflight.batch
        batch = StepBatch()
        plan = self._plan(batch, frozenset())
        if not plan.ops and not self._report_due():
            # nothing to send: computed in slots held already
            self._apply_results(plan, [], batch)
            return batch
        batch.allocator_call = True
        results = self._call(plan.ops, batch)
        if results is not None:
            self._apply_results(plan, results, batch)
        return batch

    def schedule_ahead(self, running: StepBatch) -> bool:
        """Async scheduling: plan the step after `running` (about to be
        computed) as if each sequence it samples has one more token, and send
        its call; `schedule` collects the answer after `running` sampled.
        Whether a call was sent (a step with nothing to do sends none).
        A sequence (or unforked sample) whose draw is its last (`max_tokens`)
        finishes with it: nothing is planned for that token, which is never
        computed (a sample finished so is never forked, as in the
        synchronous engine)."""
        # (a sequence that finished since `running` was launched computes
        # all the same, overlapped: what it samples is dropped)
        sampling = [e.seq for e in running.entries if e.samples and not e.seq.is_finished]
        sampling += [c for s in sampling for c in s.unforked_samples()]
        ahead = [s for s in sampling if len(s.token_ids) < s.max_computed_tokens]
        batch = StepBatch()
        plan = self._plan(batch, frozenset(ahead))
        if not plan.ops and not self._report_due():
            # nothing to send: computed in slots held already
            future: Future = Future()
            future.set_result([])
            self._inflight = InFlight(plan, batch, future)
            return False
        batch.allocator_call = True
        report = self._report()
        self._inflight = InFlight(
            plan, batch, self.calls.send_ahead(plan.ops, report, batch), report
        )
        return True

    def _collect(self, inflight: InFlight) -> None:
        """Wait for a call sent ahead and apply its answer (the time waited is
        what the step pays for the allocator)."""
        batch = inflight.batch
        results = self._received(
            lambda: inflight.future.result(), batch, inflight.plan.ops, inflight.report
        )
        if results is not None:
            self._apply_results(inflight.plan, results, batch)

    def close(self) -> None:
        """Stop the call thread, then drop the answer of a call in flight."""
        self.calls.close()
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            try:
                inflight.future.result()
            except Exception:  # noqa: BLE001, S110 - closing: nothing more to compute
                pass

    def _plan(self, batch: StepBatch, ahead: frozenset) -> StepPlan:
        """One step's operations, against the pool as they leave it (`PoolPlan`)."""
        call = self._call_needed(ahead)
        # The pool holds the tables of the sequences tracked here (finished
        # ones until their Free is sent); the others' Frees lead this call
        # (a parent freed after the forks of the last call: first in this one).
        holders = chain(self.running, self.releases.held())
        view = PoolPlan(self.num_blocks, self.block_size, (seq.block_table for seq in holders))
        plan = StepPlan(self.releases.take_frees(), view, self.max_num_batched_tokens, ahead=ahead)
        if call:  # finished sequences ride it: freed first, so their blocks serve this step
            parents = {
                c.fork_parent for c in chain(self.forking, ahead) if c.fork_parent is not None
            }
            self.releases.plan_finishing(plan, parents, self.caching)
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
            plan_appends(plan, self.running, self.lookahead, self.watermark)
        return plan

    def _call_needed(self, ahead: frozenset) -> bool:
        """Whether this step makes an allocator call: a running sequence needs
        slots it does not hold, a sample forks, or something waits to be
        freed. Finished sequences alone make one only when requests wait for
        room or nothing else runs (else they ride the next call). Admissions
        make one too (`_plan`); they wait only while requests do."""
        if (
            self.releases.frees_due()
            or self.forking
            or any(c.fork_parent is not None for c in ahead)
        ):
            return True
        if self.releases.holds_any() and (self.waiting or not self.running):
            return True
        return any(len(seq.token_ids) + (seq in ahead) > seq.num_held for seq in self.running)

    def _plan_forks(self, plan: StepPlan, children: list[Sequence]) -> None:
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
            # (a finished parent is kept until its samples forked: `plan_finishing`)
            alive = parent is not None and (
                parent.status is Status.RUNNING or self.releases.holds(parent)
            )
            if (
                not alive
                or parent.num_stored != child.num_prompt_tokens
                or parent.num_held != parent.num_stored
                or parent.num_reserved
            ):
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
            plan.view.hold(child.block_table)
            # right after its parent: preempted in the same order as it
            at = self.running.index(parent) + 1 if parent in self.running else len(self.running)
            self.running.insert(at, child)

    def _plan_running(self, plan: StepPlan, batch: StepBatch) -> None:
        """Give each running sequence its next tokens while the budget lasts,
        preempting the lowest-priority ones when blocks run short."""
        view = plan.view
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted as a victim earlier in this loop
            if plan.budget <= 0:
                break
            last = len(seq.token_ids) + (seq in plan.ahead)
            n = min(last - seq.num_stored, plan.budget)
            end = seq.num_stored + n
            while True:
                # (the allocator applies the appends in this order: a copy
                # on write is counted against what precedes it)
                cost = view.append(seq.block_table, seq.num_held, max(end, seq.num_held))
                if cost.need <= view.free:
                    break
                if self.releases.drop_flush(plan):
                    continue
                if self._unreserve(plan, cost.need - view.free):
                    continue  # other sequences' slots ahead made the room
                victim = max(self.running, key=priority_key)
                if victim in plan.running:  # give back what it was promised
                    given = plan.running.pop(victim)
                    plan.budget += given.n
                    view.give_back(given.cost)
                self._preempt(batch, victim, OUT_OF_BLOCKS, plan)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            view.take(cost)
            known = max(0, min(end, len(seq.token_ids)) - seq.num_stored)
            plan.running[seq] = Planned(
                n, cost, known, end > seq.num_held or cost.cow >= 0, end == last
            )
            plan.budget -= n

    def _unreserve(self, plan: StepPlan, short: int) -> bool:
        """Slots ahead given back to make `short` blocks free (`unreserve_ahead`)."""
        if (
            not self.lookahead
            or self.reservation != "paged"
            or UNRESERVE not in self.allocator.op_kinds
        ):
            # no slots ahead; a reservation, held to the end; or an allocator from before UNRESERVE
            return False
        return unreserve_ahead(plan, self.running, short)

    def _plan_admissions(self, plan: StepPlan) -> None:
        """Admit waiting requests while the budget, `max_num_seqs` and the free blocks allow."""
        # Keep a little headroom for the running sequences' next blocks, so a
        # new admission does not force a preemption on the very next step.
        headroom = self.watermark if self.running else 0
        seqs, view = len(self.running), plan.view
        for seq in self.waiting:
            # A request's samples are forked from it once its prompt is
            # computed: they count from its admission (n <= max_num_seqs,
            # checked at add_request, so a family alone always fits).
            family = 1 + sum(1 for c in seq.children if c.fork_parent is seq and not c.is_finished)
            if seqs + family > self.max_num_seqs:
                break
            # the most it takes: whatever it finds cached; with a reservation, all of its slots
            n = len(seq.token_ids)
            slots = reserved_slots(
                self.reservation, seq.num_prompt_tokens, seq.max_tokens, self.most_slots
            )
            worst = view.admit(n, reserve=slots - n) if slots else view.admit(n)
            if plan.budget <= 0:  # admitted next step, if its blocks are still free
                plan.queued = worst
                break
            while worst > view.free - headroom and self.releases.drop_flush(plan):
                pass
            if worst > view.free - headroom and not self._unreserve(
                plan, worst - view.free + headroom
            ):
                plan.short = True
                break
            reserve = view.admit_reserve(n, plan.budget, slots) if slots else 0
            plan.admits.append(
                Admit(seq.next_alloc_id(), seq.token_ids, seq.cache_salt, plan.budget, reserve)
            )
            plan.admitting.append(seq)
            seqs += family
            view.take_blocks(worst)
            plan.budget -= min(len(seq.token_ids), plan.budget)

    def _preempt(
        self, batch: StepBatch, seq: Sequence, cause: str, plan: StepPlan | None = None
    ) -> None:
        """Send `seq` back to the waiting queue; while planning, its Free
        joins this step (`plan`)."""
        if plan is not None:
            self._plan_preempted(plan, seq)
            if self.tiers is not None and self.tiers.swapping:
                self.tiers.swap_out(batch, seq)
        self.running.remove(seq)
        seq.reset_for_recompute()
        self.add(seq)
        batch.preempted.append(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq, cause)

    def _plan_preempted(self, plan: StepPlan, seq: Sequence) -> None:
        """A victim's Free, or (a parent its samples fork from in this call)
        its blocks kept until its Free in the next call (frees run first in
        a call); a sample forked in this call is just not forked."""
        view, ops = plan.view, plan.ops
        deferred = seq.alloc_id in plan.forked_parents and seq not in plan.forks
        table = seq.block_table
        if (u := plan.unreserves.pop(seq, None)) is not None:  # (its tail is free already)
            table = table[: u.keep]
        if not deferred:
            view.release(table)
        if seq in plan.forks:
            fork = plan.forks.pop(seq)
            ops.remove(fork)
            if all(f.parent != fork.parent for f in plan.forks.values()):
                # nothing forks from it now
                plan.forked_parents.discard(fork.parent)
                if fork.parent in self.releases.free_later:  # preempted: free it now
                    self.releases.free_later.remove(fork.parent)
                    ops.insert(0, Free(fork.parent))
                    view.release(plan.deferred.pop(fork.parent))
        elif deferred:
            self.releases.free_later.append(seq.alloc_id)
            plan.deferred[seq.alloc_id] = list(seq.block_table)
        else:
            ops.insert(0, Free(seq.alloc_id))

    # --------------------------------------------------------------- answers
    def _apply_results(self, plan: StepPlan, results: Answer, batch: StepBatch) -> None:
        """Apply the allocator's answers: block tables, copies, admissions, refusals."""
        if self.tiers is not None and isinstance(results, StepAnswer):
            moves = results.moves
            if any(moves):
                batch.moves = moves
        # `ops`: frees, forks, the finished's last Appends,
        # unreserves, the running's Appends, admits
        ri = (
            len(plan.ops)
            - len(plan.forks)
            - len(plan.flushes)
            - len(plan.unreserves)
            - len(plan.admitting)
        )
        ri -= sum(1 for p in plan.running.values() if p.op is not None)
        for child in plan.forks:
            r = results[ri]
            ri += 1
            if r.ok:  # (one finished while the call was out is in `releases` already)
                child.block_table = list(r.append)
            # else: its append fails too (unknown sequence), which sends it back to wait
        for seq, op in plan.flushes:  # values of slots held: no table change
            if results[ri].ok:
                seq.num_held, seq.num_reserved = after_append(
                    seq.num_held, seq.num_reserved, len(op.tokens), 0
                )
            ri += 1
        for seq, u in plan.unreserves.items():
            r = results[ri]
            ri += 1
            if r.ok:  # (a new list: the step in flight keeps the table it was scheduled with)
                seq.block_table = seq.block_table[: r.keep]
                seq.num_held, seq.num_reserved = after_unreserve(
                    seq.num_held, seq.num_reserved, u.slots
                )
            elif (p := plan.running.get(seq)) is not None and p.op is not None:
                # Refused (should not happen): nothing changed, it still
                # holds them; its Append sent values only, which stands.
                p.held, p.reserved = p.held + u.slots, p.reserved + u.slots
        # NOTE: a decode step's appends mostly leave the table as it is (no
        # error, no new block, no copy): read those from the result columns
        # without making an OpResult each (`StepAnswer`).
        cols = results if isinstance(results, StepAnswer) else None
        for seq, p in plan.running.items():
            if p.op is None:  # computed in slots it holds: no call for it
                if not seq.is_finished:  # (finished since: nothing sent, nothing to compute)
                    batch.add_running(seq, p)
                continue
            if (
                cols is not None
                and not seq.is_finished
                and not cols.errors[ri]
                and not cols.num_appended[ri]
                and not cols.num_copies[ri]
                and cols.keep[ri] == len(seq.block_table)
            ):
                batch.add_running(seq, p)
                ri += 1
                continue
            r = results[ri]
            ri += 1
            if seq.is_finished:
                # Finished after the call was sent (async): its Free is queued;
                # a slot reserved for it is never given a value, so never hashed.
                if r.ok:
                    batch.add_finished(seq, p, r)
                continue
            if r.ok:
                # (a new list: a step launched before this
                # answer keeps the table it was scheduled with)
                seq.block_table = [*seq.block_table[: r.keep], *r.append]
                batch.copies.extend(r.copies)
                batch.add_running(seq, p)
            else:
                # Our free-block count was off (should not happen) or the
                # allocator lost the sequence: the failed op changed nothing,
                # so recompute this one from scratch.
                self._preempt(batch, seq, r.error or "allocator_error")
                if r.error != UNKNOWN_SEQUENCE:
                    self.releases.to_free.append(seq.alloc_id)
        for seq, op in zip(plan.admitting, plan.admits, strict=True):
            r = results[ri]
            ri += 1
            if seq.is_finished:  # aborted while the call was out (async)
                if r.ok:  # admitted all the same: computed now, freed next step
                    self.releases.to_free.append(seq.alloc_id)
                    seq.block_table = list(r.append)
                    batch.add_finished(
                        seq, None, r, r.cached_tokens, r.num_stored - r.cached_tokens
                    )
            elif r.ok:
                self._admitted(batch, seq, r, op.reserve)
            elif r.error != OUT_OF_BLOCKS:
                # Refused for good (e.g. invalid): waiting would wait forever.
                seq.error = f"the allocator refused the request: {r.message or r.error}"
                self.finish(seq, "error")
                batch.failed.append(seq)

    def _call(self, ops: list[Op], batch: StepBatch) -> Answer | None:
        report = self._report()
        return self._received(lambda: self.calls.send(ops, report), batch, ops, report)

    def _report(self) -> TierReport | None:
        """The tier report the next call carries (engine thread; None: none)."""
        return None if self.tiers is None else self.tiers.take_report()

    def _report_due(self) -> bool:
        """Whether a tier report waits to be sent (a call is due for it alone)."""
        return self.tiers is not None and self.tiers.report_due()

    def _received(
        self,
        answer: Callable[[], Answer],
        batch: StepBatch,
        ops: list[Op],
        report: TierReport | None = None,
    ) -> Answer | None:
        """The step's answer to `ops` (`StepCalls.answer`), or None when the
        pool was lost (every running sequence is then preempted). A refused
        step applied nothing, so its Frees (sequences finished or preempted,
        which the scheduler no longer tracks) go out again with the next call
        made for other work: else the allocator would keep their blocks for
        as long as the worker renews its lease."""
        try:
            return self.calls.answer(answer, batch)
        except PoolLost:
            # Every block is gone: all running sequences start over.
            if self.tiers is not None:
                self.tiers.pool_lost(self.allocator)
            for seq in list(self.running):
                self._preempt(batch, seq, "pool_lost")
            self.releases.clear()
            return None
        except AllocatorFault:
            self.releases.refuse(ops)
            if self.tiers is not None:
                self.tiers.give_back(report)
            raise

    def _admitted(self, batch: StepBatch, seq: Sequence, r: OpResult, reserve: int) -> None:
        """Admitted: it holds its stored tokens and the `reserve` slots after them."""
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = Status.RUNNING
        seq.block_table = list(r.append)
        seq.num_stored = r.num_stored
        seq.num_held = r.num_stored + reserve
        seq.num_reserved = reserve
        if not seq.admitted_once:
            seq.num_cached_tokens = r.cached_tokens
            seq.admitted_once = True
        batch.cached_tokens += r.cached_tokens
        if self.caching:  # looked up only with prefix caching on, as the allocator counts it
            batch.queried_tokens += len(seq.token_ids)
        start = r.cached_tokens
        if seq.swap is not None:  # resumed, its tail swapped out: copied back, not computed
            start = self.tiers.swap_in(batch, seq, start, r.num_stored)  # type: ignore[union-attr]
        batch.entries.append(
            ScheduledSeq(
                seq,
                start,
                r.num_stored - start,
                seq.block_table,
                r.num_stored == len(seq.token_ids),
                r.cached_tokens,
            )
        )
