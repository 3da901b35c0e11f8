"""The Step wire format: the core's operations and results <-> `StepOps` /
`StepResponse` columns, shared by the server and the gRPC client.

Columns instead of one message per operation: a 256-sequence decode step is
then a few packed arrays, and both ends convert them with list operations
rather than 256 message objects (see the hot-path notes in the README).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from allocator_service.core import Admit, Append, Fork, Free, Op, OpResult, PoolStats
from allocator_service.v1 import allocator_pb2 as pb

FREE, APPEND, ADMIT, FORK = pb.OP_KIND_FREE, pb.OP_KIND_APPEND, pb.OP_KIND_ADMIT, pb.OP_KIND_FORK

# Core error code (OpResult.error) <-> wire enum.
OP_ERROR: dict[str, int] = {
    "out_of_blocks": pb.OP_ERROR_OUT_OF_BLOCKS,
    "unknown_sequence": pb.OP_ERROR_UNKNOWN_SEQUENCE,
    "sequence_exists": pb.OP_ERROR_SEQUENCE_EXISTS,
    "invalid_argument": pb.OP_ERROR_INVALID_ARGUMENT,
}
ERROR_CODE: dict[int, str] = {v: k for k, v in OP_ERROR.items()}

STATS_FIELDS = tuple(PoolStats.__slots__)


# ---------------------------------------------------------------- requests
def encode_ops(ops: Sequence[Op]) -> pb.StepOps:
    """Columns of `ops`. Raises ValueError/TypeError for a token that is not
    an integer in [0, 2^32) (protobuf refuses it)."""
    # Bound methods in locals: this loop runs once per operation per step.
    kinds: list[int] = []
    seqs: list[str] = []
    counts: list[int] = []
    tokens: list[int] = []
    kind, seq, count, extend = kinds.append, seqs.append, counts.append, tokens.extend
    admit_options: list[pb.AdmitOptions] = []
    children: list[str] = []
    for op in ops:
        t = type(op)
        if t is Append:
            kind(APPEND)
            seq(op.seq)
            count(len(op.tokens))
            extend(op.tokens)
        elif t is Free:
            kind(FREE)
            seq(op.seq)
            count(0)
        elif t is Admit:
            kind(ADMIT)
            seq(op.seq)
            count(len(op.tokens))
            extend(op.tokens)
            admit_options.append(pb.AdmitOptions(cache_salt=op.salt, num_new_tokens=op.num_new_tokens))
        elif t is Fork:
            kind(FORK)
            seq(op.parent)
            count(0)
            children.append(op.child)
        else:
            raise TypeError(f"not an operation: {op!r}")
    return pb.StepOps(
        kinds=kinds,
        seq_ids=seqs,
        num_tokens=counts,
        tokens=tokens,
        admit_options=admit_options,
        fork_children=children,
    )


def ops_digest(msg: pb.StepOps) -> bytes:
    """What a retried step id must match: SHA-256 of the canonical encoding."""
    return hashlib.sha256(msg.SerializeToString(deterministic=True)).digest()


# --------------------------------------------------------------- responses
def encode_results(step_id: int, results: Sequence[OpResult]) -> pb.StepResponse:
    errors: list[int] = []
    keep: list[int] = []
    num_appended: list[int] = []
    appended: list[int] = []
    num_copies: list[int] = []
    copies: list[int] = []
    cached: list[int] = []
    stored: list[int] = []
    messages: list[str] = []
    for r in results:
        if r.ok:
            errors.append(0)
        else:
            errors.append(OP_ERROR[r.error])
            messages.append(r.message)
        keep.append(r.keep)
        num_appended.append(len(r.append))
        appended.extend(r.append)
        num_copies.append(len(r.copies))
        for src, dst in r.copies:
            copies.append(src)
            copies.append(dst)
        cached.append(r.cached_tokens)
        stored.append(r.num_stored)
    return pb.StepResponse(
        step_id=step_id,
        errors=errors,
        keep=keep,
        num_appended=num_appended,
        appended=appended,
        num_copies=num_copies,
        copies=copies,
        cached_tokens=cached,
        num_stored=stored,
        error_messages=messages,
    )


def decode_results(resp: pb.StepResponse, num_ops: int) -> list[OpResult]:
    """`OpResult`s from response columns. Built as if every operation
    succeeded without copies (the common case, one cheap loop), then the
    few failures and copy-on-write copies are patched in."""
    errors = resp.errors
    if len(errors) != num_ops:
        raise ValueError(f"the server answered {len(errors)} results for {num_ops} operations")
    appended = list(resp.appended)
    out: list[OpResult] = []
    push = out.append
    a = 0
    for k, na, c, s in zip(resp.keep, resp.num_appended, resp.cached_tokens, resp.num_stored, strict=True):
        b = a + na
        push(OpResult(True, "", "", k, appended[a:b], [], c, s))
        a = b
    if any(errors):
        messages = iter(resp.error_messages)
        for r, e in zip(out, errors, strict=True):
            if e:
                r.ok = False
                r.error = ERROR_CODE[e]
                r.message = next(messages, "")
    copies = resp.copies
    if copies:
        c = 0
        for r, nc in zip(out, resp.num_copies, strict=True):
            if nc:
                r.copies = [(copies[j], copies[j + 1]) for j in range(c, c + 2 * nc, 2)]
                c += 2 * nc
    return out


# ------------------------------------------------------------------- stats
def stats_to_proto(stats: PoolStats, **extra) -> pb.GetPoolStatsResponse:
    return pb.GetPoolStatsResponse(**{f: getattr(stats, f) for f in STATS_FIELDS}, **extra)


def stats_from_proto(msg: pb.GetPoolStatsResponse) -> PoolStats:
    return PoolStats(**{f: getattr(msg, f) for f in STATS_FIELDS})
