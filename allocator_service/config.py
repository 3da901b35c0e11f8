"""Settings of one allocator service: lease, snapshots, and the limits that
bound what a single call can make the server do."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-call and server-wide bounds. A call over a per-call bound gets
    INVALID_ARGUMENT; one that would exceed server capacity gets
    RESOURCE_EXHAUSTED. Either way nothing changes."""

    # Operations in one Step, and tokens in one call (Step, MatchPrefix).
    max_ops_per_step: int = 16384
    max_tokens_per_call: int = 1 << 20
    # Live pools, and blocks summed over them: the metadata of one block costs
    # the server ~45-80 bytes, ~165-265 once it holds a cached hash, so 4M
    # blocks is 0.2 to 1.1 GB (core/limits.py).
    max_pools: int = 1024
    max_total_blocks: int = 1 << 22
    # Concurrent WatchEvents streams (and the HTTP port's /pools streams): each
    # holds a server thread.
    max_watchers: int = 8
    # Beside them, WatchEvents streams of callers with the router token only, so
    # that no other caller (an admin, /pools pages, anyone without tokens) can
    # take every stream and keep the routers from following the pools.
    max_router_watchers: int = 8
    # Concurrent StepStream calls (a worker's hot path as one long-lived
    # call): each holds a server thread too (started when a stream opens,
    # idle between its steps), so the server's thread pool is this much
    # larger than its unary concurrency; past it a worker is refused and
    # sends unary Steps. One allocator serves a fleet: one per worker.
    max_step_streams: int = 256
    # Slow reads (servicer.SLOTTED: block tables, stats, dumps, cache resets)
    # one pool may have in flight at once, so that one worker cannot hold every
    # thread of the server's pool (`fair_share.CallSlots`); past it RESOURCE_EXHAUSTED.
    max_calls_per_pool: int = 4
    # The same reads in flight over every pool together: the server's thread
    # pool holds this many threads for them beside the ones for short calls
    # (heartbeats, Steps, registrations: `rpc/server.py`), so no number of
    # pools' reads can take those; past it RESOURCE_EXHAUSTED.
    max_slow_calls: int = 8
    # Largest request or response on the wire (gRPC answers bigger ones with
    # RESOURCE_EXHAUSTED before any of our code runs).
    max_message_bytes: int = 16 << 20
    max_worker_id_len: int = 128

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    # A pool no call has renewed for this long is dropped.
    lease_ttl_s: float = 30.0
    # With a durable journal: write a snapshot every this many records, so a
    # restart replays at most that many.
    snapshot_every: int = 1000
    # The most bytes a snapshot may take: the pools over their share of it are
    # dropped rather than hold up every snapshot (store/cut.py). Redis's
    # own value limit is 512 MB.
    max_snapshot_bytes: int = 256 << 20
    # KV events kept for clients that reconnect to WatchEvents.
    event_retention: int = 65536
    # The per-pool CPU fair share (`fair_share.FairShare`): each pool's CPU use is
    # counted over about this long; 0 turns the fair share off.
    fair_share_window_s: float = 0.1
    # Longest a call waits at once for a lighter pool's call to finish.
    fair_share_max_wait_s: float = 0.05
    limits: Limits = field(default_factory=Limits)
    # Capacity by the admin's policy: worker id -> the most blocks its pool
    # may have, kept for it whether or not it holds a pool (a worker token's
    # BLOCKS); and the most blocks any other pool may have (None: no bound
    # but the server's total).
    reserved_blocks: Mapping[str, int] = field(default_factory=dict)
    max_pool_blocks: int | None = None
    # Trust in the shared store by the admin's policy: worker id -> its store
    # group (a worker token's `group=`, or its worker id). A pool finds and
    # loads only its own group's entries; a worker id not listed is in the
    # unnamed group of every pool registered without a worker token.
    store_groups: Mapping[str, str] = field(default_factory=dict)
    # The journal key: the record chain and the snapshot digest are
    # HMAC-SHA256 under it (`store/framing.py`); None: plain SHA-256, and
    # whoever can write to Redis is trusted with the state.
    journal_key: bytes | None = field(default=None, repr=False)
    # Where this instance notes the last record it wrote (`store/anchor.py`),
    # checked at each load: a state store rolled back or replaced is refused.
    journal_anchor_file: str | None = None
    # The shared KV store (`--kv-shared-store`): its URL ("" for none) and
    # the bytes its index may hold (`core.tiers.SharedStore`).
    shared_store: str = ""
    shared_store_bytes: int = 0
    # A hot standby (store/leader.py): follow the leader's journal and take
    # over when its lease runs out, rather than claim the state at start.
    standby: bool = False

    def __post_init__(self) -> None:
        if not self.lease_ttl_s > 0:
            raise ValueError("lease_ttl_s must be positive")
        if self.snapshot_every < 1:
            raise ValueError("snapshot_every must be at least 1")
        if self.max_snapshot_bytes < 1:
            raise ValueError("max_snapshot_bytes must be positive")
        if self.event_retention < 1:
            raise ValueError("event_retention must be at least 1")
        if self.fair_share_window_s < 0 or not self.fair_share_max_wait_s > 0:
            raise ValueError("fair_share_window_s must be >= 0 and fair_share_max_wait_s positive")
        if bool(self.shared_store) != (self.shared_store_bytes > 0):
            raise ValueError("a shared store needs its capacity in bytes, and a capacity its store")
        if self.max_pool_blocks is not None and self.max_pool_blocks < 1:
            raise ValueError("max_pool_blocks must be positive")
        if sum(self.reserved_blocks.values()) > self.limits.max_total_blocks:
            raise ValueError(
                f"the workers' quotas add up to {sum(self.reserved_blocks.values())} blocks, more "
                f"than the server's {self.limits.max_total_blocks}"
            )
