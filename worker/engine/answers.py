"""The allocator side of a scheduler step: the call, sent until it is
answered, and its answer applied to the sequences.

The worker learns each sequence's block table from these answers (and its
slots held and reserved from what it asked for once accepted): they are
what the next step is planned from (`PoolPlan`).

A step the allocator did not answer (AllocatorUnavailable: down,
restarting, its Redis away) is sent again, the SAME operations, after
pauses doubling from the first to the second value of `stall_backoff_s`,
until it is answered: the plan of this step is made (preemptions,
admissions), and the client reuses the step id, so the server applies it
exactly once. `on_stall(seconds)` is told each pause. `health` is told
whether each call was answered; any other error from the allocator is a
refusal: it becomes AllocatorFault (the step fails, nothing was applied).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from allocator_service.client import (
    OUT_OF_BLOCKS,
    UNKNOWN_SEQUENCE,
    AllocatorClient,
    AllocatorUnavailable,
    PoolLost,
)
from allocator_service.core import Free, Op, OpResult, StepAnswer
from allocator_service.core.planner import after_append, after_unreserve
from allocator_service.core.tiers import TierReport
from worker.engine.health import AllocatorFault, AllocatorHealth
from worker.engine.sequence import Sequence, Status
from worker.engine.step_plan import Planned, ScheduledSeq, StepBatch, StepPlan
from worker.engine.tiers import EngineTiers


class StepExchange:
    """The part of `Scheduler` that talks to the allocator and applies its
    answers (the queues and policy are the scheduler's)."""

    allocator: AllocatorClient
    health: AllocatorHealth
    running: list[Sequence]
    waiting: list[Sequence]
    _to_free: list[str]
    _free_later: list[str]
    _refused_frees: list[str]
    _finishing: list[Sequence]
    _flushed: list[Sequence]
    stall_backoff_s: tuple[float, float] = (0.05, 1.0)
    allocator_wait_total: float = 0.0  # seconds the engine thread spent in allocator calls, all steps
    on_stall: Callable[[float], None] | None = None
    tiers: EngineTiers | None = None

    # the scheduler's: end a sequence; send one back to wait (its blocks given back)
    finish: Callable[[Sequence, str], None]
    _preempt: Callable[..., None]

    def _apply_results(self, plan: StepPlan, results: StepAnswer | list[OpResult], batch: StepBatch) -> None:
        """Apply the allocator's answers: block tables, copies, admissions, refusals."""
        if self.tiers is not None and isinstance(results, StepAnswer):
            moves = results.moves
            if any(moves):
                batch.moves = moves
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
                seq.num_held, seq.num_reserved = after_append(seq.num_held, seq.num_reserved, len(op.tokens), 0)
            ri += 1
        for seq, u in plan.unreserves.items():
            r = results[ri]
            ri += 1
            if r.ok:  # (a new list: the step in flight keeps the table it was scheduled with)
                seq.block_table = seq.block_table[: r.keep]
                seq.num_held, seq.num_reserved = after_unreserve(seq.num_held, seq.num_reserved, u.slots)
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
                # (a new list: a step launched before this answer keeps the table it was scheduled with)
                seq.block_table = [*seq.block_table[: r.keep], *r.append]
                batch.copies.extend(r.copies)
                self._computes(batch, seq, p)
            else:
                # Our free-block count was off (should not happen) or the
                # allocator lost the sequence: the failed op changed nothing,
                # so recompute this one from scratch.
                self._preempt(batch, seq, r.error or "allocator_error")
                if r.error != UNKNOWN_SEQUENCE:
                    self._to_free.append(seq.alloc_id)
        for seq, op in zip(plan.admitting, plan.admits, strict=True):
            r = results[ri]
            ri += 1
            if seq.is_finished:  # aborted while the call was out (async)
                if r.ok:  # admitted all the same: computed now, freed next step
                    self._to_free.append(seq.alloc_id)
                    seq.block_table = list(r.append)
                    self._finished_answer(batch, seq, None, r, r.cached_tokens, r.num_stored - r.cached_tokens)
            elif r.ok:
                self._admitted(batch, seq, r, op.reserve)
            elif r.error != OUT_OF_BLOCKS:
                # Refused for good (e.g. invalid): waiting would wait forever.
                seq.error = f"the allocator refused the request: {r.message or r.error}"
                self.finish(seq, "error")
                batch.failed.append(seq)

    def _finished_answer(self, batch: StepBatch, seq: Sequence, p: Planned | None, r: OpResult,
                         start: int = 0, known: int = 0) -> None:
        """An accepted operation of a sequence that finished (an abort) after
        its call was sent ahead: the tokens with known values it stored are
        computed all the same (the allocator may have hashed their blocks, so
        another sequence could find them: a findable block holds real K/V);
        what the step samples for it is dropped (`LLMEngine._run`)."""
        if r.keep or r.append:
            seq.block_table = [*seq.block_table[: r.keep], *r.append]
        batch.copies.extend(r.copies)
        if p is not None:  # its Append (else an admission: `start`, `known`)
            start, known = seq.num_stored, p.known
            seq.num_stored += known
            seq.num_held, seq.num_reserved = p.held, p.reserved
        if known > 0:  # (nothing sampled: it would be dropped)
            batch.entries.append(ScheduledSeq(seq, start, known, seq.block_table))

    def _call(self, ops: list[Op], batch: StepBatch):
        report = self._report()
        return self._received(lambda: self._send(ops, report), batch, ops, report)

    def _report(self) -> TierReport | None:
        """The tier report the next call carries (engine thread; None: none)."""
        return None if self.tiers is None else self.tiers.take_report()

    def _report_due(self) -> bool:
        """Whether a tier report waits to be sent (a call is due for it alone)."""
        return self.tiers is not None and self.tiers.report_due()

    def _send(self, ops: list[Op], report: TierReport | None = None) -> StepAnswer | list[OpResult]:
        """Send the step until it is answered (on the call thread, with async
        scheduling and a remote allocator), with the tiers' `report`."""
        pause = self.stall_backoff_s[0]
        health = self.health
        while True:
            health.call_started()
            try:
                results = self.allocator.step(ops) if report is None else self.allocator.step(ops, report)
            except AllocatorUnavailable:
                health.unanswered()
                time.sleep(pause)
                if self.on_stall is not None:
                    self.on_stall(pause)
                pause = min(pause * 2, self.stall_backoff_s[1])
                continue
            health.answered()
            return results

    def _received(self, answer: Callable[[], StepAnswer | list[OpResult]], batch: StepBatch, ops: list[Op],
                  report: TierReport | None = None):
        """The step's answer to `ops`, or None when the pool was lost (every
        running sequence is then preempted); a refusal becomes AllocatorFault.
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
            if self.tiers is not None:
                self.tiers.pool_lost(self.allocator.shared_store, self.allocator.store_namespace)
            for seq in list(self.running):
                self._preempt(batch, seq, "pool_lost")
            self._to_free = []
            self._free_later = []
            self._refused_frees = []
            self._finishing = []
            self._flushed = []
            return None
        except Exception as exc:
            health.refused(exc)
            self._refused_frees.extend(op.seq for op in ops if isinstance(op, Free))
            if self.tiers is not None:
                self.tiers.give_back(report)
            raise AllocatorFault("allocator_refused", "the allocator refused this worker's step") from exc
        finally:
            waited = time.perf_counter() - t0
            batch.allocator_seconds += waited
            self.allocator_wait_total += waited

    def _computes(self, batch: StepBatch, seq: Sequence, p: Planned) -> None:
        """A running sequence whose Append was accepted, or that needed none:
        this step computes its next `p.n` tokens with its table as it stands
        now, in slots it holds. None when its tokens were all computed (its
        last token is being sampled: it finishes with it)."""
        if p.n:
            batch.entries.append(ScheduledSeq(seq, seq.num_stored, p.n, seq.block_table, p.samples))
        seq.num_stored += p.n
        if p.op is not None:
            seq.num_held, seq.num_reserved = p.held, p.reserved

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
        batch.queried_tokens += len(seq.token_ids)
        start = r.cached_tokens
        if seq.swap is not None:  # resumed, its tail swapped out: copied back, not computed
            start = self.tiers.swap_in(batch, seq, start, r.num_stored)  # type: ignore[union-attr]
        batch.entries.append(ScheduledSeq(seq, start, r.num_stored - start, seq.block_table,
                                          r.num_stored == len(seq.token_ids), r.cached_tokens))
