"""Run a step's columns (`StepOps`) straight on a `BlockPool`.

This is `core.execute_step` + `codec.encode_results` without the objects in
between: no `Op` per operation on the way in, no `OpResult` on the way out.
For a 256-sequence decode step those objects cost more than the block logic
itself (frozen dataclasses are slow to build), and this is the server's hot
path. The semantics are execute_step's, and a property test holds them
equal (tests/test_service_columns.py): frees first, then the rest in the
given order; each operation all-or-nothing; an AllocatorError is that
operation's result, never the call's.
"""

from __future__ import annotations

from itertools import accumulate, chain

from allocator_service.codec import ADMIT, APPEND, FORK, FREE, OP_ERROR
from allocator_service.core import AllocatorError, BlockPool
from allocator_service.errors import BadRequest
from allocator_service.v1 import allocator_pb2 as pb

_KINDS = frozenset((FREE, APPEND, ADMIT, FORK))


def validate(msg: pb.StepOps, max_ops: int, max_tokens: int) -> None:
    """Refuse (BadRequest) columns that do not fit together or exceed the
    limits, before anything is applied. Per-operation validity (sequence
    ids, salts, num_new_tokens) is the core's business: a per-op result."""
    kinds = list(msg.kinds)
    n = len(kinds)
    if n > max_ops:
        raise BadRequest(f"{n} operations in one step; the limit is {max_ops}")
    if len(msg.seq_ids) != n or len(msg.num_tokens) != n:
        raise BadRequest("kinds, seq_ids and num_tokens must have one entry per operation")
    if len(msg.tokens) > max_tokens:
        raise BadRequest(f"{len(msg.tokens)} tokens in one step; the limit is {max_tokens}")
    if sum(msg.num_tokens) != len(msg.tokens):
        raise BadRequest("num_tokens does not add up to the number of tokens sent")
    if not set(kinds) <= _KINDS:
        raise BadRequest("an operation kind is not FREE, APPEND, ADMIT or FORK")
    if kinds.count(ADMIT) != len(msg.admit_options):
        raise BadRequest("admit_options must have one entry per ADMIT operation")
    if kinds.count(FORK) != len(msg.fork_children):
        raise BadRequest("fork_children must have one entry per FORK operation")
    if (FREE in kinds or FORK in kinds) and any(
        c for k, c in zip(kinds, msg.num_tokens, strict=True) if k == FREE or k == FORK
    ):
        raise BadRequest("FREE and FORK operations carry no tokens")


def run_step(pool: BlockPool, step_id: int, msg: pb.StepOps) -> pb.StepResponse:
    """Apply validated columns; the response columns are exactly
    `encode_results(step_id, execute_step(pool, decoded ops))`."""
    kinds = list(msg.kinds)
    seqs = list(msg.seq_ids)
    n = len(kinds)
    tokens = list(msg.tokens)
    offsets = list(accumulate(msg.num_tokens, initial=0))
    errors = [0] * n
    keep = [0] * n
    num_appended = [0] * n
    appended: list[list[int]] = [[]] * n  # shared empty list, only read
    num_copies = [0] * n
    copies: list[int] = []
    cached = [0] * n
    stored = [0] * n
    messages: dict[int, str] = {}

    def failed(i: int, exc: AllocatorError) -> None:
        errors[i] = OP_ERROR[exc.code]
        messages[i] = str(exc)

    if FREE in kinds:
        for i in range(n):
            if kinds[i] == FREE:
                try:
                    pool.free(seqs[i])
                except AllocatorError as exc:
                    failed(i, exc)
    admits = iter(msg.admit_options)
    children = iter(msg.fork_children)
    for i in range(n):
        kind = kinds[i]
        try:
            if kind == APPEND:
                start = offsets[i]
                if offsets[i + 1] - start == 1 and (k := pool.try_append_one(seqs[i], tokens[start])) >= 0:
                    keep[i] = k  # a decode token into a private block with room
                    continue
                r = pool.append(seqs[i], tokens[start : offsets[i + 1]])
                keep[i] = r.keep
                if r.new_blocks:
                    appended[i] = r.new_blocks
                    num_appended[i] = len(r.new_blocks)
                if r.copies:
                    num_copies[i] = len(r.copies)
                    copies.extend(chain.from_iterable(r.copies))
            elif kind == ADMIT:
                o = next(admits)
                a = pool.admit(
                    seqs[i],
                    tokens[offsets[i] : offsets[i + 1]],
                    o.cache_salt if o.HasField("cache_salt") else None,
                    o.num_new_tokens if o.HasField("num_new_tokens") else None,
                )
                appended[i] = a.table
                num_appended[i] = len(a.table)
                cached[i] = a.cached_tokens
                stored[i] = a.num_stored
            elif kind == FORK:
                table = pool.fork(seqs[i], next(children))
                appended[i] = table
                num_appended[i] = len(table)
        except AllocatorError as exc:
            failed(i, exc)
    return pb.StepResponse(
        step_id=step_id,
        errors=errors,
        keep=keep,
        num_appended=num_appended,
        appended=list(chain.from_iterable(appended)),
        num_copies=num_copies,
        copies=copies,
        cached_tokens=cached,
        num_stored=stored,
        error_messages=[messages[i] for i in sorted(messages)],
    )
