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
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from allocator_service.client import AllocatorClient, AllocatorUnavailable, PoolLost
from allocator_service.core import Admit, Append, Fork, Free, Op, OpResult, StepResults, blocks_for
from worker.engine.health import AllocatorError, AllocatorHealth
from worker.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_computed: int  # tokens already in the cache before this step
    num_new: int  # tokens whose K/V this step computes

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
    cached_tokens: int = 0  # prompt tokens served from the prefix cache this step
    queried_tokens: int = 0


@dataclass(slots=True)
class _StepPlan:
    """One step in the making: the operations to send and what they used up."""

    ops: list[Op]
    refs: Counter  # block -> running sequences holding it
    free: int  # blocks free for this step's appends and admits
    budget: int  # tokens left in this step
    # seq -> (new tokens, new blocks, the shared block it copies on write or -1)
    running: dict[Sequence, tuple[int, int, int]] = field(default_factory=dict)
    admitting: list[Sequence] = field(default_factory=list)
    forks: dict[Sequence, Fork] = field(default_factory=dict)  # child -> its Fork op
    forked_parents: set[str] = field(default_factory=set)  # alloc ids forked from this step


def _priority_key(seq: Sequence) -> tuple[int, float]:
    return (seq.params.priority, seq.arrival_time)


class Scheduler:
    def __init__(
        self,
        allocator: AllocatorClient,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_preempt: Callable[[Sequence, str], None] | None = None,
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
        self._free_later: list[str] = []  # parents whose samples fork this step: freed after
        self.forking: list[Sequence] = []  # samples that drew their first token, to fork next step
        self.on_preempt = on_preempt
        self.health = AllocatorHealth()

    # ---------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_priority_key)

    def add_fork(self, child: Sequence) -> None:
        """A sample that drew its first token from its parent's prompt logits:
        forked from the parent in the next step."""
        self.forking.append(child)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished; its blocks are freed in the next step's call."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._to_free.append(seq.alloc_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.forking:
            self.forking.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_free or self.forking or self._free_later)

    # ------------------------------------------------------------------ step
    def schedule(self) -> Batch:
        """Plan the step, send it in one allocator call, apply the answers."""
        batch = Batch()
        refs = Counter(b for seq in self.running for b in seq.block_table)
        plan = _StepPlan(
            ops=[Free(a) for a in self._to_free],
            refs=refs,
            free=self.num_blocks - len(refs),
            budget=self.max_num_batched_tokens,
        )
        self._to_free = self._free_later
        self._free_later = []
        self._plan_forks(plan)
        self._plan_running(plan, batch)
        if not batch.preempted:
            self._plan_admissions(plan)
        if not plan.ops:
            return batch
        results = self._call(plan.ops, batch)
        if results is not None:
            self._apply_results(plan, results, batch)
        return batch

    def _plan_forks(self, plan: _StepPlan) -> None:
        """Fork the samples that drew their first token last step from their
        parent, which then holds exactly the prompt. A parent that finished
        last step is freed one step later, after the forks; one no longer in
        the allocator leaves its samples to be admitted on their own."""
        if not self.forking:
            return
        freeing = {op.seq: op for op in plan.ops if isinstance(op, Free)}
        for child in self.forking:
            parent = child.fork_parent
            child.fork_parent = None
            alive = parent is not None and (parent.status is Status.RUNNING or parent.alloc_id in freeing
                                            or parent.alloc_id in self._free_later)
            if not alive or parent.num_stored != child.num_prompt_tokens:
                self.add(child)  # recompute: admitted like any request
                continue
            if parent.alloc_id in freeing:  # finished last step: free it after its forks
                plan.ops.remove(freeing.pop(parent.alloc_id))
                self._free_later.append(parent.alloc_id)
            op = Fork(parent.alloc_id, child.next_alloc_id())
            plan.ops.append(op)
            plan.forks[child] = op
            plan.forked_parents.add(parent.alloc_id)
            child.status = Status.RUNNING
            child.block_table = list(parent.block_table)
            child.num_stored = parent.num_stored
            child.admitted_once = True
            child.num_cached_tokens = parent.num_cached_tokens
            plan.refs.update(child.block_table)
            # right after its parent: preempted in the same order as it
            at = self.running.index(parent) + 1 if parent in self.running else len(self.running)
            self.running.insert(at, child)
        self.forking = []

    def _plan_running(self, plan: _StepPlan, batch: Batch) -> None:
        """Give each running sequence its next tokens while the budget lasts,
        preempting the lowest-priority ones when blocks run short."""
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted as a victim earlier in this loop
            if plan.budget <= 0:
                break
            n = min(len(seq.token_ids) - seq.num_stored, plan.budget)
            while True:
                # A write into a partly filled block others share copies it
                # first (the allocator applies the appends in this order).
                cow = -1
                if seq.num_stored % self.block_size and plan.refs[seq.block_table[-1]] > 1:
                    cow = seq.block_table[-1]
                need = self._blocks_needed(seq, n) + (cow >= 0)
                if need <= plan.free:
                    break
                victim = max(self.running, key=_priority_key)
                if victim in plan.running:  # give back what it was promised
                    k, v_need, v_cow = plan.running.pop(victim)
                    plan.budget += k
                    plan.free += v_need
                    if v_cow >= 0:  # it holds the shared block again until its free
                        plan.refs[v_cow] += 1
                plan.free += self._preempt(batch, victim, plan.refs, plan.ops, "out_of_blocks", plan)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            if cow >= 0:
                plan.refs[cow] -= 1  # the shared block loses this holder
            plan.running[seq] = (n, need, cow)
            plan.free -= need
            plan.budget -= n
        plan.ops.extend(
            Append(s.alloc_id, s.token_ids[s.num_stored : s.num_stored + n]) for s, (n, _, _) in plan.running.items()
        )

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
            if plan.budget <= 0 or seqs + family > self.max_num_seqs:
                break
            # Upper bound of the blocks an admit takes from the free queue
            # (cache hits on free blocks leave the queue too).
            worst = blocks_for(len(seq.token_ids), self.block_size)
            if worst > plan.free - headroom:
                break
            plan.ops.append(Admit(seq.next_alloc_id(), seq.token_ids, seq.cache_salt, plan.budget))
            plan.admitting.append(seq)
            seqs += family
            plan.free -= worst
            plan.budget -= min(len(seq.token_ids), plan.budget)

    def _apply_results(self, plan: _StepPlan, results: StepResults | list[OpResult], batch: Batch) -> None:
        """Apply the allocator's answers: block tables, copies, admissions, refusals."""
        # `ops`: frees, forks, appends, admits
        ri = len(plan.ops) - len(plan.forks) - len(plan.running) - len(plan.admitting)
        for child in plan.forks:
            r = results[ri]
            ri += 1
            if r.ok:
                child.block_table = list(r.append)
            # else: its append fails too (unknown sequence), which sends it back to wait
        # NOTE: a decode step's appends mostly leave the table as it is (no
        # error, no new block, no copy): read those from the result columns
        # without making an OpResult each (`StepResults`).
        cols = results.columns if isinstance(results, StepResults) else None
        for seq, (n, _, _) in plan.running.items():
            if (cols is not None and not cols.errors[ri] and not cols.num_appended[ri]
                    and not cols.num_copies[ri] and cols.keep[ri] == len(seq.block_table)):
                ri += 1
                batch.entries.append(ScheduledSeq(seq, seq.num_stored, n))
                seq.num_stored += n
                continue
            r = results[ri]
            ri += 1
            if r.ok:
                seq.block_table[r.keep :] = r.append
                batch.copies.extend(r.copies)
                batch.entries.append(ScheduledSeq(seq, seq.num_stored, n))
                seq.num_stored += n
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
            if r.ok:
                self._admitted(batch, seq, r)
            elif r.error != "out_of_blocks":
                # Refused for good (e.g. invalid): waiting would wait forever.
                seq.error = f"the allocator refused the request: {r.message or r.error}"
                self.finish(seq, "error")
                batch.failed.append(seq)

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
        t0 = time.perf_counter()
        pause = self.stall_backoff_s[0]
        health = self.health
        try:
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
        except PoolLost:
            # Every block is gone: all running sequences start over.
            health.answered()  # the client registered a fresh pool
            for seq in list(self.running):
                self._preempt(batch, seq, None, None, "pool_lost")
            self._to_free = []
            return None
        except Exception as exc:
            health.refused(exc)
            raise AllocatorError("allocator_refused", "the allocator refused this worker's step") from exc
        finally:
            batch.allocator_seconds += time.perf_counter() - t0

    def _admitted(self, batch: Batch, seq: Sequence, r: OpResult) -> None:
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = Status.RUNNING
        seq.block_table = list(r.append)
        seq.num_stored = r.num_stored
        if not seq.admitted_once:
            seq.num_cached_tokens = r.cached_tokens
            seq.admitted_once = True
        batch.cached_tokens += r.cached_tokens
        batch.queried_tokens += len(seq.token_ids)
        batch.entries.append(ScheduledSeq(seq, r.cached_tokens, r.num_stored - r.cached_tokens))

    def _preempt(self, batch: Batch, seq: Sequence, refs: Counter | None, ops: list[Op] | None, cause: str,
                 plan: _StepPlan | None = None) -> int:
        """Send `seq` back to the waiting queue. With `ops`, its Free joins
        this step; returns the blocks that frees (those no other sequence holds)."""
        freed = 0
        if refs is not None:
            for b in seq.block_table:
                refs[b] -= 1
                if refs[b] == 0:
                    del refs[b]
                    freed += 1
        if plan is not None and seq in plan.forks:  # forked this step: just do not fork it
            fork = plan.forks.pop(seq)
            ops.remove(fork)
            if fork.parent in self._free_later and all(f.parent != fork.parent for f in plan.forks.values()):
                self._free_later.remove(fork.parent)  # nothing forks from it now: free it now
                plan.forked_parents.discard(fork.parent)
                ops.insert(0, Free(fork.parent))
        elif plan is not None and seq.alloc_id in plan.forked_parents:
            self._free_later.append(seq.alloc_id)  # frees run first: after its forks, next step
        elif ops is not None:
            ops.insert(0, Free(seq.alloc_id))
        self.running.remove(seq)
        seq.reset_for_recompute()
        self.add(seq)
        batch.preempted.append(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq, cause)
        return freed
