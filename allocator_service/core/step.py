"""A scheduler step: an ordered batch of operations on one pool.

A worker sends ONE step per scheduler iteration. Frees run first (so the
blocks they release serve the same step's admits and appends), then the other
operations in the order given. Each operation is all-or-nothing and one
failing operation does not fail the others: its result says why.

The table change of an operation is `keep` (a prefix of the old table that
stays) plus `append` (new block ids after it); this one shape expresses growth,
copy-on-write (keep = len - 1) and admission (keep = 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from allocator_service.core.errors import AllocatorError
from allocator_service.core.pool import BlockPool


@dataclass(frozen=True, slots=True)
class Free:
    seq: str


@dataclass(frozen=True, slots=True)
class Append:
    seq: str
    tokens: Sequence[int]


@dataclass(frozen=True, slots=True)
class Admit:
    seq: str
    tokens: Sequence[int]
    salt: str | None = None
    # Tokens past the cached prefix to store now (chunked prefill); None = all.
    num_new_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Fork:
    parent: str
    child: str


Op = Free | Append | Admit | Fork


@dataclass(slots=True)
class OpResult:
    ok: bool = True
    error: str = ""  # AllocatorError.code when not ok
    message: str = ""
    keep: int = 0
    append: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    cached_tokens: int = 0
    num_stored: int = 0  # admit: tokens the sequence holds after this step


def apply_op(pool: BlockPool, op: Op) -> OpResult:
    """Run one operation; an AllocatorError becomes a failed result."""
    try:
        if isinstance(op, Append):
            if len(op.tokens) == 1 and (keep := pool.try_append_one(op.seq, op.tokens[0])) >= 0:
                return OpResult(keep=keep)
            r = pool.append(op.seq, op.tokens)
            return OpResult(keep=r.keep, append=r.new_blocks, copies=r.copies)
        if isinstance(op, Admit):
            a = pool.admit(op.seq, op.tokens, op.salt, op.num_new_tokens)
            return OpResult(append=a.table, cached_tokens=a.cached_tokens, num_stored=a.num_stored)
        if isinstance(op, Free):
            pool.free(op.seq)
            return OpResult()
        if isinstance(op, Fork):
            table = pool.fork(op.parent, op.child)
            return OpResult(append=table)
    except AllocatorError as exc:
        return OpResult(ok=False, error=exc.code, message=str(exc))
    raise TypeError(f"not an operation: {op!r}")


def execute_step(pool: BlockPool, ops: Sequence[Op]) -> list[OpResult]:
    """Apply a step's operations (frees first) and return results in the
    order the operations were given."""
    results: list[OpResult | None] = [None] * len(ops)
    for i, op in enumerate(ops):
        if isinstance(op, Free):
            results[i] = apply_op(pool, op)
    for i, op in enumerate(ops):
        if not isinstance(op, Free):
            results[i] = apply_op(pool, op)
    return results  # type: ignore[return-value]
