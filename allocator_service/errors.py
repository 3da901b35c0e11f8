"""Every error the service can answer, and the ONE table mapping it to a
gRPC status code.

The service raises domain exceptions (these classes, and the core's
`AllocatorError`s); only `abort()` turns them into a status. Each carries a
stable machine-readable `code`, sent as the `pagedkv-error` trailing
metadata so a client can tell "your pool is gone" from "unknown sequence"
without parsing the message. Anything else reaching `abort()` is a bug: it is
logged with its traceback and the client sees INTERNAL with no detail.
"""

from __future__ import annotations

import logging

import grpc

from allocator_service.core.errors import (
    AllocatorError,
    InvalidArgument,
    OutOfBlocks,
    PoolLimit,
    SequenceExists,
    UnknownSequence,
)

log = logging.getLogger(__name__)

ERROR_KEY = "pagedkv-error"
# Trailing metadata of a `NotLeader` answer: where the leader serves (HOST:PORT).
LEADER_KEY = "pagedkv-leader"


class ServiceError(AllocatorError):
    """Base of the service's own errors (the core's cover the block logic)."""


class BadRequest(ServiceError):
    """Malformed request or one over the documented limits."""

    code = "invalid_argument"


class Unauthenticated(ServiceError):
    """Missing or wrong bearer token, or no pool credential presented."""

    code = "unauthenticated"


class PermissionDenied(ServiceError):
    """A pool credential that is not this pool's."""

    code = "permission_denied"


class PoolNotFound(ServiceError):
    """No such pool: never registered, deregistered, expired or replaced."""

    code = "pool_not_found"

    def __init__(self, pool_id: str) -> None:
        super().__init__(f"no pool {pool_id!r} (never registered, dropped, or its lease expired)")
        self.pool_id = pool_id


class StepConflict(ServiceError):
    """A step id the pool's history cannot accept (reused with other
    operations, or older than the last step)."""

    code = "step_conflict"


class PoolInUse(ServiceError):
    """RegisterPool of a worker id whose pool is live, without that pool's
    credential (`replace_credential`): wait for its lease to expire."""

    code = "pool_in_use"


class CapacityExceeded(ServiceError):
    """Server-wide capacity: pools, blocks, watchers."""

    code = "capacity"


class QuotaExceeded(CapacityExceeded):
    """A pool larger than the admin lets its worker have (a worker token's
    quota, `--max-pool-blocks`): asking again cannot pass (RESOURCE_EXHAUSTED,
    `quota`)."""

    code = "quota"


class StepStreamsExhausted(CapacityExceeded):
    """Every StepStream the server serves at once is open: the client sends
    unary Steps instead (RESOURCE_EXHAUSTED, `step_streams`)."""

    code = "step_streams"


class TooManyCalls(CapacityExceeded):
    """A pool already has as many slow reads in flight as one pool may
    (`Limits.max_calls_per_pool`; RESOURCE_EXHAUSTED, `pool_calls`)."""

    code = "pool_calls"


class AnswerTooLarge(CapacityExceeded):
    """An answer that could exceed the largest message on the wire
    (`Limits.max_message_bytes`; RESOURCE_EXHAUSTED, `answer_too_large`): a
    Step refused before it is journaled or applied (send its operations in
    smaller steps), or a DumpPool of a pool too large to dump in one answer
    (refused before it is built when its floor says so)."""

    code = "answer_too_large"


class ShuttingDown(ServiceError):
    """The server is stopping: a step stream is ended (UNAVAILABLE, so the
    worker retries the step at the next server)."""

    code = "shutting_down"


class NotLeader(ServiceError):
    """This allocator is a standby (`store/leader.py`): UNAVAILABLE, so the
    client retries, with the leader's address (`LEADER_KEY`, empty while no
    lease is alive) for a client that knows several addresses to go there."""

    code = "not_leader"

    def __init__(self, leader: str) -> None:
        super().__init__(f"this allocator is a standby; the leader is {leader or 'being elected'}")
        self.leader = leader


class StoreUnavailable(ServiceError):
    """The durable state store (Redis) did not answer; nothing was applied."""

    code = "store_unavailable"


class StoreLost(StoreUnavailable):
    """The state store lost what this instance wrote (its keys vanished, or
    its journal head is behind): Redis was flushed, evicted keys, restarted
    without its data or failed over to a lagging replica."""


class StoreFenced(StoreUnavailable):
    """Another allocator instance took ownership of the state."""


class StoreMisconfigured(StoreUnavailable):
    """The state store is set up so that it may drop journal records (an
    eviction policy other than `noeviction`)."""


class PoolStateLost(PoolNotFound):
    """The worker's step follows a step the allocator no longer has (its
    journal lost records): the pool was dropped; NOT_FOUND, so the worker
    re-registers and recomputes (`PoolLost`)."""

    def __init__(self, pool_id: str, message: str) -> None:
        ServiceError.__init__(self, message)
        self.pool_id = pool_id


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
    return grpc.StatusCode.INTERNAL, "internal"


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
