"""Domain errors of the allocator core.

Every failure a caller can provoke is one of these classes. The transport
layers (gRPC servicer, replay tool, HTTP) map them to their own status codes in
ONE place each, keyed by `code`; nothing else in the core raises.
"""

from __future__ import annotations


class AllocatorError(Exception):
    """Base class. `code` is a stable machine-readable reason."""

    code = "error"


class OutOfBlocks(AllocatorError):
    """Not enough free blocks for the operation. Nothing was changed."""

    code = "out_of_blocks"

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"out of blocks: need {needed}, {available} free")
        self.needed = needed
        self.available = available


class UnknownSequence(AllocatorError):
    code = "unknown_sequence"

    def __init__(self, seq_id: str) -> None:
        super().__init__(f"unknown sequence {seq_id!r}")
        self.seq_id = seq_id


class SequenceExists(AllocatorError):
    code = "sequence_exists"

    def __init__(self, seq_id: str) -> None:
        super().__init__(f"sequence {seq_id!r} already exists")
        self.seq_id = seq_id


class InvalidArgument(AllocatorError):
    """Malformed input: bad token ids, bad shapes, bad names."""

    code = "invalid_argument"


class PoolLimit(AllocatorError):
    """The operation would make the pool hold more sequences or table entries
    than its shape allows (`limits.max_sequences`, `limits.max_table_entries`).
    Nothing was changed; freeing sequences makes room again."""

    code = "pool_limit"
