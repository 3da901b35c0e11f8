"""The ONE table from the allocator's refusals to gRPC status codes, and the
abort every handler and interceptor ends a refused call with.

Anything that is not a refusal reaching `abort()` is a bug: it is logged with
its traceback and the client sees INTERNAL with no detail.
"""

from __future__ import annotations

import logging

import grpc

from allocator_service.core.errors import (
    InvalidArgument,
    OutOfBlocks,
    PoolLimit,
    SequenceExists,
    UnknownSequence,
)
from allocator_service.wire.errors import (
    ERROR_KEY,
    INTERNAL,
    LEADER_KEY,
    BadRequest,
    CapacityExceeded,
    NotLeader,
    PermissionDenied,
    PoolInUse,
    PoolNotFound,
    ShuttingDown,
    StepConflict,
    StoreUnavailable,
    Unauthenticated,
)

log = logging.getLogger(__name__)

# The one mapping. Keyed by class; the most specific match wins (the MRO walk
# in `status_for`), so a subclass of InvalidArgument is INVALID_ARGUMENT too.
STATUS: dict[type[Exception], grpc.StatusCode] = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    PoolNotFound: grpc.StatusCode.NOT_FOUND,
    UnknownSequence: grpc.StatusCode.NOT_FOUND,
    StepConflict: grpc.StatusCode.FAILED_PRECONDITION,
    PoolInUse: grpc.StatusCode.FAILED_PRECONDITION,
    SequenceExists: grpc.StatusCode.FAILED_PRECONDITION,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PoolLimit: grpc.StatusCode.RESOURCE_EXHAUSTED,
    OutOfBlocks: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    NotLeader: grpc.StatusCode.UNAVAILABLE,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, machine-readable reason) for an exception."""
    for cls in type(exc).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status, getattr(exc, "code", "error")
    return grpc.StatusCode.INTERNAL, INTERNAL


def abort(context: grpc.ServicerContext, exc: BaseException, method: str = "") -> None:
    """End the call with the status `exc` maps to (raises, as context.abort does)."""
    status, code = status_for(exc)
    if status is grpc.StatusCode.INTERNAL:
        log.error("internal error in %s", method or "a call", exc_info=exc)
        message = "internal error"
    else:
        message = str(exc)
    trailer = ((ERROR_KEY, code),)
    if isinstance(exc, NotLeader):
        trailer += ((LEADER_KEY, exc.leader),)
    context.set_trailing_metadata(trailer)
    context.abort(status, message)
