"""The interface every allocator client implements, and the in-process one.

`AllocatorClient` is one worker's view of its pool; `EmbeddedAllocator` runs
the core in the worker's own process. `GrpcAllocator` (grpc_client.py)
implements the same interface over the shared service.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from allocator_service.core import (
    KINDS,
    BlockPool,
    Op,
    PoolConfig,
    PoolStats,
    StepAnswer,
    run_step,
    step_columns,
)
from allocator_service.core.tier_index import SharedStore
from allocator_service.core.tiers import TierReport


class PoolLost(Exception):
    """The allocator dropped this worker's pool (lease expired, allocator
    state lost). The client has registered a fresh pool; every sequence the
    worker held is gone and must be recomputed."""


class AllocatorUnavailable(ConnectionError):
    """The allocator did not answer within the client's retries. The step's
    outcome is unknown: calling `step` again with the same operations is
    safe (the gRPC client reuses the step id, and the server applies a step
    id once)."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What a worker asks for when it registers its KV pool: its id and the
    pool's shape, the core's `PoolConfig` (validated when the spec is built);
    and, for routers that discover workers through the allocator, where it
    serves HTTP and the model name it serves (empty: not advertised)."""

    worker_id: str
    config: PoolConfig
    advertise_url: str = ""
    served_model_name: str = ""


class AllocatorClient(abc.ABC):
    """One worker's view of its pool. Not thread-safe: the engine loop calls it."""

    spec: PoolSpec
    # The operation kinds the allocator applies (a gRPC allocator says at
    # registration, `RegisterPoolResponse.op_kinds`): a worker sends no
    # other, since an allocator refuses a step with a kind it does not know.
    op_kinds: frozenset[int] = frozenset(KINDS)
    # The shared KV store's URL (`file://...`, `redis://...`) this pool saves
    # to and loads from, learned at registration; None: the pool uses none.
    # A pool registered with `use_shared_store` at an allocator that has no
    # store is registered without it (`spec.config.use_shared_store` then
    # says False): the worker asks to use the store if there is one.
    shared_store: str | None = None
    # Where this pool's blocks live in that store (`RegisterPoolResponse.
    # store_namespace`): the store keys of its own saves and loads.
    store_namespace: str = ""
    # A `peer://` store: the key this pool's store group presents to its
    # workers' peer routes (`RegisterPoolResponse.peer_key`).
    peer_key: str = ""
    peer_store_bytes: int = 0  # ... and the store's capacity in bytes

    @abc.abstractmethod
    def step(self, ops: Sequence[Op], report: TierReport | None = None) -> StepAnswer:
        """Apply one scheduler step (frees first); the answer in the given
        order (`StepAnswer`: columns, read as `OpResult`s when asked, so a
        256-operation step builds no object per operation unless asked).
        With KV tiers, `report` confirms (or fails, or refuses) the moves of
        earlier answers, and `StepAnswer.moves` are this step's moves, for
        the worker to apply before its forward pass (docs/architecture.md,
        "Tiers")."""

    @abc.abstractmethod
    def stats(self) -> PoolStats: ...

    @abc.abstractmethod
    def block_table(self, seq_id: str) -> list[int]: ...

    @abc.abstractmethod
    def reset_prefix_cache(self) -> int: ...

    @abc.abstractmethod
    def dump(self) -> dict[str, Any]:
        """The pool's whole state as `BlockPool.to_state()` gives it (JSON
        types), for tools: `BlockPool.from_state` rebuilds it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the pool (deregister) and any connection."""

    def identity(self, nonce: str) -> dict[str, str] | None:
        """The answer to a router's challenge (`attest.py`): this pool's id,
        its worker id and the proof over `nonce`; None when no shared
        allocator lists the pool (nobody routes to it through one)."""
        return None


class EmbeddedAllocator(AllocatorClient):
    """The allocator core in the worker's own process. `shared_store`: the
    store's URL and its index (`SharedStore(capacity_bytes)`), for the pool
    to save to and load from when its config asks; several embedded
    allocators given one index share the store (their steps on one thread)."""

    def __init__(self, spec: PoolSpec, shared_store: tuple[str, SharedStore] | None = None) -> None:
        config = spec.config
        store = None
        if config.use_shared_store:
            if shared_store is None:
                config = replace(config, use_shared_store=False)
                spec = replace(spec, config=config)
            else:
                self.shared_store, store = shared_store
                self.store_namespace = config.store_namespace
        self.spec = spec
        self.pool = BlockPool(config, store=store)

    def step(self, ops: Sequence[Op], report: TierReport | None = None) -> StepAnswer:
        return run_step(self.pool, step_columns(ops, report))

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def block_table(self, seq_id: str) -> list[int]:
        return self.pool.block_table(seq_id)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def dump(self) -> dict[str, Any]:
        # NOTE: through JSON, as the gRPC client gets it: a copy, JSON types.
        return json.loads(json.dumps(self.pool.to_state()))
