"""The allocator client interface a worker programs against.

`AllocatorClient` has two implementations with the same behaviour:
`EmbeddedAllocator` (the core in-process, the default) and `GrpcAllocator`
(the shared service, `allocator_service.client.grpc_client`, imported lazily
so an embedded worker never loads grpc). The worker imports only this module
and `connect()`.
"""

from __future__ import annotations

from allocator_service.client.base import (
    AllocatorClient,
    AllocatorUnavailable,
    EmbeddedAllocator,
    PoolLost,
    PoolSpec,
)

__all__ = ["AllocatorClient", "AllocatorUnavailable", "EmbeddedAllocator", "PoolLost", "PoolSpec", "connect"]


def connect(target: str, spec: PoolSpec, **options) -> AllocatorClient:
    """`embedded` -> in-process core; `HOST:PORT` -> the gRPC service."""
    if target == "embedded":
        return EmbeddedAllocator(spec)
    from allocator_service.client.grpc_client import GrpcAllocator

    return GrpcAllocator(target, spec, **options)
