"""Applying a step to a pool: `run_step`, the one implementation of a Step
on columns (`StepColumns` in, `StepAnswer` out), and `step_columns`, the
columns of operation objects. What a step and its answer are: `step.py`.

Compiled with the core's hot modules (setup.py): the loops here run once
per operation of every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, compress

from allocator_service.core.errors import AllocatorError
from allocator_service.core.pool import BlockPool
from allocator_service.core.step import (
    ADMIT,
    APPEND,
    ERROR_NUMBER,
    FORK,
    FREE,
    UNRESERVE,
    Admit,
    Append,
    Fork,
    Free,
    Op,
    StepAnswer,
    StepColumns,
    Unreserve,
)
from allocator_service.core.tiers import NO_MOVES, TierReport
from allocator_service.core.validation import tokens_ok


def run_step(pool: BlockPool, step: StepColumns) -> StepAnswer:
    """Apply a step's operations (frees first) and return the results in
    the order the operations were given. The columns must fit together
    (one entry per operation, per ADMIT, per FORK; token counts adding up):
    the service checks what it receives before calling this.

    With KV tiers the worker's confirmations are applied first (an id the
    pool could not have issued raises InvalidArgument before anything
    changes), and the answer carries the moves the operations issued
    (`StepAnswer.moves`)."""
    kinds, seqs, counts, tokens, salts, budgets, children, reserved, report, valid = step
    tiered = pool.tiers is not None
    if report is not None and any(report):
        pool.confirm(*report)
    elif tiered:
        pool.confirm()
    n = len(kinds)
    if not reserved:
        reserved = [0] * n
    errors = [0] * n
    keep = [0] * n
    num_appended = [0] * n
    appended: list[int] = []
    num_copies = [0] * n
    copies: list[int] = []
    cached = [0] * n
    stored = [0] * n
    messages: dict[int, str] = {}  # by operation: frees fail first, out of order
    if FREE in kinds:
        for i in range(n):
            if kinds[i] == FREE:
                try:
                    pool.free(seqs[i])
                except AllocatorError as exc:
                    errors[i] = ERROR_NUMBER[exc.code]
                    messages[i] = str(exc)
    end = 0  # where the next operation's tokens end
    admits = forks = 0  # ADMIT and FORK operations met so far
    # every token of the step at once (C speed), not one operation at a time
    checked = valid or tokens_ok(tokens)
    # NOTE: the appends of a decode step (slots in each sequence's private
    # last block, or blocks from the free queue past its end) take the pool's
    # fast path, a run of them per call: no AppendResult, no copies (the hot
    # loop of a step). With a bad token in the step every operation takes
    # the general rules, which refuse it.
    append_run = pool.append_run if checked else None
    # the operations that are not APPENDs, then n: where each run of APPENDs stops
    stops = [*compress(range(n), map(APPEND.__ne__, kinds)), n]
    s = 0  # stops[s]: the first stop at or after operation i
    i = 0
    while i < n:
        if append_run is not None and kinds[i] == APPEND:
            while stops[s] < i:
                s += 1
            i, end = append_run(
                seqs, counts, tokens, reserved, keep, num_appended, appended, i, stops[s], end
            )
            if i == n:
                break
        op = i  # applied by the general rules
        i += 1
        kind = kinds[op]
        start = end
        end += counts[op]
        seq = seqs[op]
        try:
            if kind == APPEND:
                r = pool.append(seq, tokens[start:end], reserved[op], checked=checked)
                keep[op] = r.keep
                if r.new_blocks:
                    appended += r.new_blocks
                    num_appended[op] = len(r.new_blocks)
                if r.copies:
                    num_copies[op] = len(r.copies)
                    copies.extend(chain.from_iterable(r.copies))
            elif kind == ADMIT:
                admits += 1
                a = pool.admit(
                    seq,
                    tokens[start:end],
                    salts[admits - 1],
                    budgets[admits - 1],
                    reserved[op],
                    checked=checked,
                )
                appended += a.table
                num_appended[op] = len(a.table)
                cached[op] = a.cached_tokens
                stored[op] = a.num_stored
            elif kind == FORK:
                forks += 1
                table = pool.fork(seq, children[forks - 1])
                appended += table
                num_appended[op] = len(table)
            elif kind == UNRESERVE:
                keep[op] = pool.unreserve(seq, reserved[op])
            elif kind != FREE:
                # The service refuses unknown kinds before this; a journal
                # written by a newer allocator must not replay with an
                # operation skipped (its tables would differ from the workers').
                raise ValueError(f"operation kind {kind} is not one this allocator applies")
        except AllocatorError as exc:
            errors[op] = ERROR_NUMBER[exc.code]
            messages[op] = str(exc)
    return StepAnswer(
        errors,
        keep,
        num_appended,
        appended,
        num_copies,
        copies,
        cached,
        stored,
        [messages[i] for i in sorted(messages)] if messages else [],
        pool.take_moves() if tiered else NO_MOVES,
    )


def step_columns(ops: Sequence[Op], report: TierReport | None = None) -> StepColumns:
    """The columns of `ops`, with the worker's `report` on earlier moves
    (TypeError for anything that is not an operation)."""
    # Bound methods in locals: this loop runs once per operation per step.
    kinds: list[int] = []
    seqs: list[str] = []
    counts: list[int] = []
    tokens: list[int] = []
    kind, seq, count, extend = kinds.append, seqs.append, counts.append, tokens.extend
    salts: list[str | None] = []
    budgets: list[int | None] = []
    children: list[str] = []
    reserves: list[tuple[int, int]] = []  # (operation, slots) of those that reserve or give back
    # NOTE: the operation types and kinds in locals: they live in `step.py`, which is not
    # compiled, and a global of an interpreted module is a dict lookup at each use.
    append_op, free_op, admit_op, fork_op, unreserve_op = Append, Free, Admit, Fork, Unreserve
    append_k, free_k, admit_k, fork_k, unreserve_k = APPEND, FREE, ADMIT, FORK, UNRESERVE
    for i, op in enumerate(ops):
        if type(op) is append_op:
            kind(append_k)
            seq(op.seq)
            count(len(op.tokens))
            extend(op.tokens)
            if op.reserve:
                reserves.append((i, op.reserve))
        elif type(op) is free_op:
            kind(free_k)
            seq(op.seq)
            count(0)
        elif type(op) is admit_op:
            kind(admit_k)
            seq(op.seq)
            count(len(op.tokens))
            extend(op.tokens)
            salts.append(op.salt)
            budgets.append(op.num_new_tokens)
            if op.reserve:
                reserves.append((i, op.reserve))
        elif type(op) is fork_op:
            kind(fork_k)
            seq(op.parent)
            count(0)
            children.append(op.child)
        elif type(op) is unreserve_op:
            kind(unreserve_k)
            seq(op.seq)
            count(0)
            reserves.append((i, op.slots))
        else:
            raise TypeError(f"not an operation: {op!r}")
    reserved: list[int] = []  # empty unless an operation reserves or gives back
    if reserves:
        reserved = [0] * len(kinds)
        for i, slots in reserves:
            reserved[i] = slots
    return StepColumns(kinds, seqs, counts, tokens, salts, budgets, children, reserved, report)


def execute_step(pool: BlockPool, ops: Sequence[Op]) -> StepAnswer:
    """`run_step` on operation objects: the answer in the order given."""
    return run_step(pool, step_columns(ops))
