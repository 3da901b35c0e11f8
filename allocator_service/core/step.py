"""A scheduler step: an ordered batch of operations on one pool.

- Frees run first (their blocks serve the same step), then the other
  operations in the order given; each is all-or-nothing, and one failing
  fails no other: its result says why.
- An operation's table change is `keep` (the old table's prefix that stays)
  plus `append` (new block ids): growth, copy-on-write (keep = len - 1),
  admission (keep = 0) and unreserve (keep < len, nothing appended).
- `run_step` (`run.py`) is the one implementation, on columns
  (`StepColumns` in, `StepAnswer` out, `StepAnswer[i]` operation i's
  `OpResult`); `step_columns` builds columns from the operation objects
  (`Free`, `Append`, `Admit`, `Fork`, `Unreserve`). This module says what
  a step and its answer are.
- An APPEND or ADMIT may reserve slots (`num_reserved`) whose values come
  first in the sequence's next APPEND; an UNRESERVE gives them back
  (`BlockPool.append`, `.admit`, `.unreserve`).

The rules and reasons: docs/architecture.md, "The block contract".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple, cast, overload

from allocator_service.core.errors import (
    InvalidArgument,
    OutOfBlocks,
    PoolLimit,
    SequenceExists,
    UnknownSequence,
)
from allocator_service.core.tiers import NO_MOVES, Moves, TierReport

# Operation kinds in `StepColumns.kinds`.
# NOTE: the numbers of the wire enum `OpKind`, so the service passes the
# column through unchanged (the codec checks they agree).
FREE, APPEND, ADMIT, FORK, UNRESERVE = 1, 2, 3, 4, 5
KINDS = (FREE, APPEND, ADMIT, FORK, UNRESERVE)  # every kind `run_step` applies

# `AllocatorError.code` -> its number in `StepAnswer.errors` (0: succeeded).
# NOTE: the numbers of the wire enum `OpError`, as for the kinds.
ERROR_NUMBER: dict[str, int] = {
    OutOfBlocks.code: 1,
    UnknownSequence.code: 2,
    SequenceExists.code: 3,
    InvalidArgument.code: 4,
    PoolLimit.code: 5,
}
ERROR_CODE: dict[int, str] = {v: k for k, v in ERROR_NUMBER.items()}


class StepColumns(NamedTuple):
    """A step's operations as columns (the shape of the wire's `StepOps`)."""

    kinds: list[int]  # one per operation: FREE, APPEND, ADMIT, FORK or UNRESERVE
    seq_ids: list[str]  # one per operation: the sequence (FORK: the parent)
    num_tokens: list[int]  # one per operation: its tokens (0 for FREE, FORK and UNRESERVE)
    # every operation's tokens, concatenated in order (a list, or the wire's field)
    tokens: Sequence[int]
    salts: list[str | None]  # one per ADMIT: its cache_salt
    num_new_tokens: list[int | None]  # one per ADMIT: chunked prefill bound (None: all)
    children: list[str]  # one per FORK: the child's sequence id
    # Empty (nothing reserved), or one per operation: slots an APPEND or an
    # ADMIT reserves after its tokens for tokens not known yet, or an
    # UNRESERVE gives back (0 elsewhere).
    num_reserved: list[int] = []  # noqa: RUF012 - a NamedTuple default, never mutated
    # KV tiers (docs/architecture.md, "Tiers"): the worker's report on the
    # moves of earlier answers, applied before the operations (None: none).
    report: TierReport | None = None
    # True: every token is known to be an int in [0, MAX_TOKEN_ID] (decoded
    # from the wire's uint32 field: `wire.codec.columns_from_proto`), so
    # `run_step` does not check them again. False: it checks them.
    tokens_valid: bool = False


@dataclass(slots=True)
class OpResult:
    """One operation's answer (`StepAnswer[i]`)."""

    ok: bool = True
    error: str = ""  # AllocatorError.code when not ok
    message: str = ""
    keep: int = 0
    append: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    cached_tokens: int = 0
    num_stored: int = 0  # admit: tokens the sequence holds after this step


@dataclass(slots=True, eq=False)
class StepAnswer(Sequence[OpResult]):
    """A step's answer: per-operation columns named as the wire's
    `StepResponse` fields, and the step's tier `moves`. From `run_step` the
    columns are lists; from a gRPC client they are the response's own
    repeated fields, read in place (sequences that compare equal to lists).

    Read as a sequence of `OpResult`s (`answer[i]`, iteration), each made
    when asked; a consumer on the hot path reads the columns instead
    (`errors[i]`, `keep[i]`, `num_appended[i]`, `num_copies[i]`,
    `appended_of(i)`, `copies_of(i)`), so a decode step whose operations
    changed nothing in their tables costs no object per operation. Compares
    equal to an answer of equal columns and to a list of the same `OpResult`s."""

    # The columns the wire's `StepResponse` carries under these names.
    COLUMNS = (
        "errors",
        "keep",
        "num_appended",
        "appended",
        "num_copies",
        "copies",
        "cached_tokens",
        "num_stored",
        "error_messages",
    )

    errors: Sequence[int]  # one per operation: 0, or ERROR_NUMBER of why it failed
    keep: Sequence[int]  # one per operation: entries of the old table kept
    num_appended: Sequence[int]  # one per operation: block ids it appends
    appended: Sequence[int]  # every operation's appended block ids, concatenated
    num_copies: Sequence[int]  # one per operation: block copies to perform first
    copies: Sequence[int]  # every operation's (src, dst) copies, flattened
    # one per operation: prompt tokens found cached (ADMIT; tier loads included)
    cached_tokens: Sequence[int]
    num_stored: Sequence[int]  # one per operation: tokens held after an ADMIT
    error_messages: Sequence[str]  # one per FAILED operation, in order
    # KV tiers: the step's moves, applied by the worker before the forward
    # pass (`tiers.Moves` says in which order; NO_MOVES without tiers).
    moves: Moves = NO_MOVES
    # where each operation's ids start
    _starts: list[int] | None = field(default=None, init=False, repr=False)
    _copy_starts: list[int] | None = field(default=None, init=False, repr=False)
    # failed op -> its message
    _messages: dict[int, str] | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return len(self.errors)

    @property
    def all_ok(self) -> bool:
        return not any(self.errors)

    def appended_of(self, i: int) -> list[int]:
        """The block ids operation i appends to its table (after `keep[i]`)."""
        n = self.num_appended[i]
        if not n:
            return []
        if self._starts is None:
            self._starts = list(accumulate(self.num_appended, initial=0))
        a = self._starts[i]
        # a slice of a list, or of the wire's repeated field, is a list
        return cast(list[int], self.appended[a : a + n])

    def copies_of(self, i: int) -> list[tuple[int, int]]:
        """The (src, dst) block copies operation i needs first."""
        n = self.num_copies[i]
        if not n:
            return []
        if self._copy_starts is None:
            self._copy_starts = list(accumulate(self.num_copies, initial=0))
        c, flat = 2 * self._copy_starts[i], self.copies
        return [(flat[j], flat[j + 1]) for j in range(c, c + 2 * n, 2)]

    def _op(self, i: int) -> OpResult:
        """Operation i's `OpResult` (0 <= i < len): the one decoder of the columns."""
        e = self.errors[i]
        if e:
            if self._messages is None:
                failed = [j for j, x in enumerate(self.errors) if x]
                self._messages = dict(zip(failed, self.error_messages, strict=False))
            return OpResult(
                False,
                ERROR_CODE[e],
                self._messages.get(i, ""),
                self.keep[i],
                self.appended_of(i),
                self.copies_of(i),
                self.cached_tokens[i],
                self.num_stored[i],
            )
        return OpResult(
            True,
            "",
            "",
            self.keep[i],
            self.appended_of(i),
            self.copies_of(i),
            self.cached_tokens[i],
            self.num_stored[i],
        )

    @overload
    def __getitem__(self, i: int) -> OpResult: ...
    @overload
    def __getitem__(self, i: slice) -> list[OpResult]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._op(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("step answer index out of range")
        return self._op(i)

    def __iter__(self) -> Iterator[OpResult]:
        return map(self._op, range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepAnswer):
            return (
                all(getattr(self, f) == getattr(other, f) for f in self.COLUMNS)
                and self.moves == other.moves
            )
        if isinstance(other, list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepAnswer({list(self)!r}, moves={self.moves!r})"


# ------------------------------------------------------ the operation objects
@dataclass(frozen=True, slots=True)
class Free:
    seq: str


@dataclass(frozen=True, slots=True)
class Append:
    seq: str
    tokens: Sequence[int]
    # Slots held after `tokens` for tokens not known yet; their values come
    # with the sequence's next Append, first in its `tokens` (async scheduling).
    reserve: int = 0


@dataclass(frozen=True, slots=True)
class Admit:
    seq: str
    tokens: Sequence[int]
    salt: str | None = None
    # Tokens past the cached prefix to store now (chunked prefill); None = all.
    num_new_tokens: int | None = None
    # Slots held after the tokens it stores, for tokens not known yet (a
    # reservation made at admission: `BlockPool.admit`).
    reserve: int = 0


@dataclass(frozen=True, slots=True)
class Fork:
    parent: str
    child: str


@dataclass(frozen=True, slots=True)
class Unreserve:
    """Give back the last `slots` reserved slots of `seq` (slots held for
    tokens not known yet); blocks left holding no slot become free."""

    seq: str
    slots: int


Op = Free | Append | Admit | Fork | Unreserve
