"""The allocator client interface a worker programs against.

`AllocatorClient` has two implementations with the same behaviour:
`EmbeddedAllocator` (the core in-process, the default) and `GrpcAllocator`
(the shared service, `allocator_service.client.grpc_client`, imported lazily
so an embedded worker never loads grpc). The worker imports only this module
and `connect()`, and matches an operation's `OpResult.error` against the
reason constants exported here, never a string.
"""

from __future__ import annotations

from allocator_service.client.base import (
    AllocatorClient,
    AllocatorUnavailable,
    EmbeddedAllocator,
    PoolLost,
    PoolSpec,
)
from allocator_service.wire.errors import (
    INVALID_ARGUMENT,
    OUT_OF_BLOCKS,
    POOL_LIMIT,
    SEQUENCE_EXISTS,
    UNKNOWN_SEQUENCE,
)

__all__ = [
    "INVALID_ARGUMENT",
    "OUT_OF_BLOCKS",
    "POOL_LIMIT",
    "SEQUENCE_EXISTS",
    "UNKNOWN_SEQUENCE",
    "AllocatorClient",
    "AllocatorUnavailable",
    "EmbeddedAllocator",
    "PoolLost",
    "PoolSpec",
    "connect",
]


def connect(target: str, spec: PoolSpec, **options) -> AllocatorClient:
    """`embedded` -> in-process core; `HOST:PORT` -> the gRPC service."""
    if target == "embedded":
        return EmbeddedAllocator(spec)
    from allocator_service.client.grpc_client import GrpcAllocator

    return GrpcAllocator(target, spec, **options)
