"""The allocator's block logic as a pure library.

Imports no grpc, redis, prometheus or torch: the embedded allocator of a
worker, the gRPC service and the offline tools all run this same code.
Its hot modules run compiled where they were built (`native` says which
build runs, and decides it before any of them is imported).
"""

from allocator_service.core import native  # noqa: F401  # isort: split
from allocator_service.core.blocks import blocks_for
from allocator_service.core.contiguous import ContiguousPool
from allocator_service.core.errors import (
    AllocatorError,
    InvalidArgument,
    OutOfBlocks,
    PoolLimit,
    SequenceExists,
    UnknownSequence,
)
from allocator_service.core.pool import AdmitResult, AppendResult, BlockPool
from allocator_service.core.prefix_index import ALL_CLEARED, BLOCK_REMOVED, BLOCK_STORED
from allocator_service.core.run import execute_step, run_step, step_columns
from allocator_service.core.state import PoolConfig, PoolStats
from allocator_service.core.step import (
    KINDS,
    UNRESERVE,
    Admit,
    Append,
    Fork,
    Free,
    Op,
    OpResult,
    StepAnswer,
    StepColumns,
    Unreserve,
)
from allocator_service.core.validation import check_cache_salt

__all__ = [
    "KINDS",
    "UNRESERVE",
    "blocks_for",
    "check_cache_salt",
    "ALL_CLEARED",
    "BLOCK_REMOVED",
    "BLOCK_STORED",
    "Admit",
    "AdmitResult",
    "AllocatorError",
    "Append",
    "AppendResult",
    "BlockPool",
    "ContiguousPool",
    "Fork",
    "Free",
    "InvalidArgument",
    "Op",
    "OpResult",
    "OutOfBlocks",
    "PoolLimit",
    "PoolConfig",
    "PoolStats",
    "SequenceExists",
    "StepAnswer",
    "StepColumns",
    "UnknownSequence",
    "Unreserve",
    "execute_step",
    "run_step",
    "step_columns",
]
