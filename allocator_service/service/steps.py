"""The Step path: a pool's operations checked, journaled, applied once.

A step is refused whole (BadRequest, AnswerTooLarge, StepConflict) before it
is journaled, or applied by `run_step` under its pool's lock after the
journal write; a retry of the last step id with the same operations gets
the first answer. Conversion, validation and the digest run before any lock.
"""

from __future__ import annotations

import logging
from itertools import compress

from allocator_service.config import Limits
from allocator_service.core import StepColumns
from allocator_service.core.errors import InvalidArgument, UnknownSequence
from allocator_service.core.step import ADMIT, FORK, FREE, KINDS, UNRESERVE
from allocator_service.service.changes import Changes, PoolRef
from allocator_service.store.framing import StepRecord
from allocator_service.store.registry import PoolEntry
from allocator_service.wire.bounds import step_answer_bound, tier_bound
from allocator_service.wire.codec import PREV_STEP_ID_REQUIRED, digest_of
from allocator_service.wire.errors import AnswerTooLarge, BadRequest, PoolStateLost, StepConflict
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import journal_pb2 as jpb

log = logging.getLogger(__name__)

_KINDS = frozenset(KINDS)
_TOKENLESS = frozenset((FREE, FORK, UNRESERVE))


def check_step(step: StepColumns, limits: Limits) -> None:
    """Refuse (BadRequest) columns that exceed the limits or do not fit
    together, before anything is applied. Per-operation validity (sequence
    ids, tokens, salts, num_new_tokens) is the core's business: a per-op result."""
    kinds, counts = step.kinds, step.num_tokens
    n = len(kinds)
    if n > limits.max_ops_per_step:
        raise BadRequest(f"{n} operations in one step; the limit is {limits.max_ops_per_step}")
    if len(step.seq_ids) != n or len(counts) != n:
        raise BadRequest("kinds, seq_ids and num_tokens must have one entry per operation")
    if len(step.tokens) > limits.max_tokens_per_call:
        raise BadRequest(
            f"{len(step.tokens)} tokens in one step; the limit is {limits.max_tokens_per_call}"
        )
    if sum(counts) != len(step.tokens):
        raise BadRequest("num_tokens does not add up to the number of tokens sent")
    reserved = step.num_reserved
    if reserved:
        if len(reserved) != n:
            raise BadRequest("num_reserved must be empty or have one entry per operation")
        if any(r for k, r in zip(kinds, reserved, strict=True) if k == FREE or k == FORK):
            raise BadRequest("num_reserved is for APPEND, ADMIT and UNRESERVE operations only")
        # slots APPENDs and ADMITs take (at C speed: this runs on every async step)
        taken = sum(reserved)
        if UNRESERVE in kinds:
            taken -= sum(compress(reserved, map(UNRESERVE.__eq__, kinds)))
        if taken + len(step.tokens) > limits.max_tokens_per_call:
            raise BadRequest(
                f"{taken} reserved slots and {len(step.tokens)} tokens in one step; "
                f"the limit is {limits.max_tokens_per_call}"
            )
    if not set(kinds) <= _KINDS:
        raise BadRequest("an operation kind is not FREE, APPEND, ADMIT, FORK or UNRESERVE")
    if kinds.count(ADMIT) != len(step.salts):
        raise BadRequest("admit_options must have one entry per ADMIT operation")
    if kinds.count(FORK) != len(step.children):
        raise BadRequest("fork_children must have one entry per FORK operation")
    # NOTE: compress/map rather than a generator: C speed over every operation.
    if (FREE in kinds or FORK in kinds or UNRESERVE in kinds) and any(
        compress(counts, map(_TOKENLESS.__contains__, kinds))
    ):
        raise BadRequest("FREE, FORK and UNRESERVE operations carry no tokens")


class Steps:
    """A pool's changes to its blocks: Step and ResetPrefixCache."""

    def __init__(self, changes: Changes, limits: Limits) -> None:
        self.changes = changes
        self.limits = limits

    def step(
        self,
        ref: PoolRef,
        step_id: int,
        step: StepColumns,
        encoded: bytes,
        prev_step_id: int | None = None,
    ) -> pb.StepResponse:
        """Apply `step` (its operations, `encoded` as `codec.canonical_ops`
        encodes them: what the journal stores and a retry's digest covers)
        as the pool's step `step_id`. The answer is the one the pool keeps
        for a retry, in its wire form."""
        if step_id < 1:
            raise BadRequest("step_id must be positive")
        check_step(step, self.limits)
        digest = digest_of(encoded)
        changes = self.changes

        def attempt() -> pb.StepResponse:
            entry = changes.authorize(ref)
            if prev_step_id is None and entry.protocol_version >= PREV_STEP_ID_REQUIRED:
                raise BadRequest(
                    f"pool {entry.pool_id} was registered with protocol_version "
                    f"{entry.protocol_version}: every Step must carry prev_step_id"
                )
            with entry.lock:
                if step_id <= entry.last_step_id:
                    if step_id == entry.last_step_id and digest == entry.last_digest:
                        return entry.last_response  # a retry: same answer, applied once
                    if step_id == entry.last_step_id:
                        raise StepConflict(
                            f"step {step_id} was already applied with other operations"
                        )
                    raise StepConflict(
                        f"step {step_id} is older than the pool's last step {entry.last_step_id}"
                    )
                if prev_step_id is not None and prev_step_id != entry.last_step_id:
                    self._state_lost(entry, prev_step_id)
                self._check_report(entry, step)
                self._check_answer(entry, step)
                record = StepRecord(entry.pool_id, step_id, digest, encoded)
                return changes.apply(
                    entry,
                    lambda reg, batch: reg.apply_step(entry, batch, step_id, digest, step),
                    shared=changes.registry.uses_store(entry),
                    step=record,
                )

        response = changes.retrying(attempt)
        changes.durable.after_change()
        return response

    def reset_prefix_cache(self, ref: PoolRef, admin: bool = False) -> int:
        """Forget every cached block of the pool; how many were dropped."""
        changes = self.changes

        def attempt() -> int:
            entry = changes.authorize(ref, admin)
            with entry.lock:
                return changes.apply(
                    entry,
                    lambda reg, batch: reg.apply_reset(entry, batch),
                    reset=jpb.PrefixCacheReset(pool_id=entry.pool_id),
                )

        dropped = changes.retrying(attempt)
        changes.durable.after_change()
        return dropped

    @staticmethod
    def _check_report(entry: PoolEntry, step: StepColumns) -> None:
        """Refuse (BadRequest) a tier report naming what the pool could not
        have issued, before it is journaled (the pool's lock held)."""
        report = step.report
        if report is None or not any(report):
            return
        try:
            entry.pool.check_report(*report)
        except InvalidArgument as exc:
            raise BadRequest(str(exc)) from None

    def _check_answer(self, entry: PoolEntry, step: StepColumns) -> None:
        """Refuse (AnswerTooLarge) a step whose answer could be larger than
        the wire carries, before it is journaled: a refused call changes
        nothing (the pool's lock held)."""
        pool = entry.pool

        def held(seq_id: str) -> int | None:
            try:
                return pool.num_tokens(seq_id)
            except UnknownSequence:
                return None

        tiers = None
        if pool.tiers is not None:
            store = pool.tiers.store
            tiers = tier_bound(
                store.capacity_bytes if store is not None else 0,
                self.changes.registry.store_min_bytes,
                pool.config.block_bytes,
                store is not None and store.peer,
            )
        bound = step_answer_bound(step, pool.num_blocks, pool.block_size, held, tiers)
        limit = self.limits.max_message_bytes
        if bound > limit:
            raise AnswerTooLarge(
                f"the answer to these {len(step.kinds)} operations could take up to {bound} bytes, "
                f"more than the {limit} a message may; nothing was applied: "
                "send them in smaller steps"
            )

    def _state_lost(self, entry: PoolEntry, prev_step_id: int) -> None:
        """The worker got an answer for a step this server does not have (its
        journal lost records): drop the pool before it hands out a block the
        worker still uses; NOT_FOUND makes the worker re-register and recompute."""
        message = (
            f"pool {entry.pool_id} was dropped: its worker follows step {prev_step_id} but the "
            f"allocator's last step for it is {entry.last_step_id} (the allocator's state lost "
            "records)"
        )
        changes = self.changes
        with changes.lock:
            changes.live(entry)
            log.error("%s", message)
            changes.drop(entry.pool_id, "state_lost")
        raise PoolStateLost(entry.pool_id, message)
