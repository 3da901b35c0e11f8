"""Every refusal the allocator answers, and the reason each carries.

The service raises these classes and the core's `AllocatorError`s; the gRPC
servicer turns them into a status through ONE table (`rpc/status.py`), the
HTTP port through its own. Each carries a stable machine-readable `code`,
sent as the `ERROR_KEY` trailing metadata, so a client tells "your pool is
gone" from "unknown sequence" without parsing the message: clients match
the constants below, never a string.
"""

from __future__ import annotations

from allocator_service.core.errors import (
    AllocatorError,
    InvalidArgument,
    OutOfBlocks,
    PoolLimit,
    SequenceExists,
    UnknownSequence,
)

# The trailing metadata key of a refusal's reason.
ERROR_KEY = "pagedkv-error"
# Trailing metadata of a `NotLeader` answer: where the leader serves (HOST:PORT).
LEADER_KEY = "pagedkv-leader"

# The reasons (`code`) on the wire. The core's:
INVALID_ARGUMENT = InvalidArgument.code
OUT_OF_BLOCKS = OutOfBlocks.code
POOL_LIMIT = PoolLimit.code
SEQUENCE_EXISTS = SequenceExists.code
UNKNOWN_SEQUENCE = UnknownSequence.code
# ... and the service's:
UNAUTHENTICATED = "unauthenticated"
PERMISSION_DENIED = "permission_denied"
POOL_NOT_FOUND = "pool_not_found"
STEP_CONFLICT = "step_conflict"
POOL_IN_USE = "pool_in_use"
CAPACITY = "capacity"
QUOTA = "quota"
STEP_STREAMS = "step_streams"
POOL_CALLS = "pool_calls"
ANSWER_TOO_LARGE = "answer_too_large"
SHUTTING_DOWN = "shutting_down"
STORE_UNAVAILABLE = "store_unavailable"
NOT_LEADER = "not_leader"
# what `rpc/status.py` answers for an exception that is not a refusal (a bug)
INTERNAL = "internal"


class ServiceError(AllocatorError):
    """Base of the service's own errors (the core's cover the block logic)."""


class BadRequest(ServiceError):
    """Malformed request or one over the documented limits."""

    code = INVALID_ARGUMENT


class Unauthenticated(ServiceError):
    """Missing or wrong bearer token, or no pool credential presented."""

    code = UNAUTHENTICATED


class PermissionDenied(ServiceError):
    """A pool credential that is not this pool's."""

    code = PERMISSION_DENIED


class PoolNotFound(ServiceError):
    """No such pool: never registered, deregistered, expired or replaced."""

    code = POOL_NOT_FOUND

    def __init__(self, pool_id: str) -> None:
        super().__init__(f"no pool {pool_id!r} (never registered, dropped, or its lease expired)")
        self.pool_id = pool_id


class StepConflict(ServiceError):
    """A step id the pool's history cannot accept (reused with other
    operations, or older than the last step)."""

    code = STEP_CONFLICT


class PoolInUse(ServiceError):
    """RegisterPool of a worker id whose pool is live, without that pool's
    credential (`replace_credential`): wait for its lease to expire."""

    code = POOL_IN_USE


class CapacityExceeded(ServiceError):
    """Server-wide capacity: pools, blocks, watchers."""

    code = CAPACITY


class QuotaExceeded(CapacityExceeded):
    """A pool larger than the admin lets its worker have (a worker token's
    quota, `--max-pool-blocks`): asking again cannot pass (RESOURCE_EXHAUSTED,
    `quota`)."""

    code = QUOTA


class StepStreamsExhausted(CapacityExceeded):
    """Every StepStream the server serves at once is open: the client sends
    unary Steps instead (RESOURCE_EXHAUSTED, `step_streams`)."""

    code = STEP_STREAMS


class TooManyCalls(CapacityExceeded):
    """A pool already has as many slow reads in flight as one pool may
    (`Limits.max_calls_per_pool`; RESOURCE_EXHAUSTED, `pool_calls`)."""

    code = POOL_CALLS


class AnswerTooLarge(CapacityExceeded):
    """An answer that could exceed the largest message on the wire
    (`Limits.max_message_bytes`; RESOURCE_EXHAUSTED, `answer_too_large`): a
    Step refused before it is journaled or applied (send its operations in
    smaller steps), or a DumpPool of a pool too large to dump in one answer
    (refused before it is built when its floor says so)."""

    code = ANSWER_TOO_LARGE


class ShuttingDown(ServiceError):
    """The server is stopping: a step stream is ended (UNAVAILABLE, so the
    worker retries the step at the next server)."""

    code = SHUTTING_DOWN


class NotLeader(ServiceError):
    """This allocator is a standby (`store/leader.py`): UNAVAILABLE, so the
    client retries, with the leader's address (`LEADER_KEY`, empty while no
    lease is alive) for a client that knows several addresses to go there."""

    code = NOT_LEADER

    def __init__(self, leader: str) -> None:
        super().__init__(f"this allocator is a standby; the leader is {leader or 'being elected'}")
        self.leader = leader


class StoreUnavailable(ServiceError):
    """The durable state store (Redis) did not answer; nothing was applied."""

    code = STORE_UNAVAILABLE


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
