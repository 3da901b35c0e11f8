"""A pool's shape (`PoolConfig`), figures (`PoolStats`) and state as parts
(`PoolParts`), and `PoolState`: what the checks (`integrity.py`) and the
dumps (`snapshot.py`) read of a pool. They sit below `holdings.py`, so the pool
calls them and they import nothing of it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from allocator_service.core.block_hashes import BlockHashes
from allocator_service.core.errors import InvalidArgument
from allocator_service.core.limits import (
    MAX_BLOCK_BYTES,
    MAX_BLOCK_SIZE,
    MAX_FINGERPRINT_LEN,
    MAX_HOST_BLOCKS,
    MAX_NUM_BLOCKS,
)
from allocator_service.core.prefix_index import PrefixIndex
from allocator_service.core.sequence import SeqEntry
from allocator_service.core.tier_index import check_store_names, store_namespace
from allocator_service.core.tiers import PoolTiers

# A pool's parts in prefill/decode disaggregation (docs/architecture.md).
KV_ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = False
    model_fingerprint: str = ""
    # KV tiers (docs/architecture.md, "Tiers"); all off by default. Tiers
    # index blocks by hash, so they need prefix caching.
    host_blocks: int = 0  # slots of the worker's host tier (0: none)
    layout: str = ""  # the KV layout key: which store entries this pool's blocks can load
    block_bytes: int = 0  # bytes of one block's K and V (a store entry's size)
    use_shared_store: bool = False  # whether the pool saves to and loads from the shared store
    # The store group the allocator placed the pool in (its trust domain in
    # the store: "" for none); never the worker's own say (service.pools).
    store_group: str = ""
    # Its part in prefill/decode disaggregation (KV_ROLES): "both" computes and answers
    # whole requests; "prefill" and "decode" pools move blocks through the shared store.
    kv_role: str = "both"

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or not 1 <= self.num_blocks <= MAX_NUM_BLOCKS:
            raise InvalidArgument(f"num_blocks must be an integer in [1, {MAX_NUM_BLOCKS}]")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise InvalidArgument(f"block_size must be an integer in [1, {MAX_BLOCK_SIZE}]")
        if len(self.model_fingerprint) > MAX_FINGERPRINT_LEN:
            raise InvalidArgument(
                f"model_fingerprint is longer than {MAX_FINGERPRINT_LEN} characters"
            )
        if type(self.host_blocks) is not int or not 0 <= self.host_blocks <= MAX_HOST_BLOCKS:
            raise InvalidArgument(f"host_blocks must be an integer in [0, {MAX_HOST_BLOCKS}]")
        check_store_names(self.layout, self.store_group)
        if type(self.block_bytes) is not int or not 0 <= self.block_bytes <= MAX_BLOCK_BYTES:
            raise InvalidArgument(f"block_bytes must be an integer in [0, {MAX_BLOCK_BYTES}]")
        if (self.host_blocks or self.use_shared_store) and not self.enable_prefix_caching:
            raise InvalidArgument("KV tiers (host_blocks, use_shared_store) need prefix caching")
        if self.kv_role not in KV_ROLES:
            raise InvalidArgument(f"kv_role must be one of {', '.join(KV_ROLES)}")
        if self.kv_role != "both" and not self.use_shared_store:
            raise InvalidArgument(
                f"a {self.kv_role} pool needs the shared store (the blocks move through it): "
                "the allocator has no --kv-shared-store, or the worker opted out of it"
            )
        if self.use_shared_store and (not self.layout or not self.block_bytes):
            raise InvalidArgument(
                "a pool that uses the shared store needs its layout and block_bytes"
            )

    @property
    def tiered(self) -> bool:
        """Whether the pool has a tier below its KV pool."""
        return bool(self.host_blocks or self.use_shared_store)

    @property
    def store_namespace(self) -> str:
        """Where the pool's blocks live in the shared store ("" without one)."""
        return store_namespace(self.store_group, self.layout) if self.use_shared_store else ""


@dataclass(slots=True)
class PoolStats:
    num_blocks: int
    block_size: int
    used_blocks: int
    cached_blocks: int  # free blocks still holding a reusable hash
    free_blocks: int  # all free blocks, cached ones included
    num_sequences: int
    tokens_stored: int  # token slots holding a token (shared blocks counted once)
    slots_allocated: int  # used_blocks * block_size
    prefix_queried_tokens: int  # prompt tokens admissions looked up
    prefix_hit_tokens: int  # ... found: in the KV pool, or a tier load issued (`TierStats`)
    evictions: int
    copies: int
    out_of_blocks: int

    @property
    def utilisation(self) -> float:
        """Tokens stored over slots allocated (1.0 when nothing is allocated)."""
        return self.tokens_stored / self.slots_allocated if self.slots_allocated else 1.0

    @property
    def wasted_slots(self) -> int:
        return self.slots_allocated - self.tokens_stored

    @property
    def prefix_hit_rate(self) -> float:
        q = self.prefix_queried_tokens
        return self.prefix_hit_tokens / q if q else 0.0


class PoolParts(NamedTuple):
    """What a pool holds beyond its config and counters, as its own
    containers (`BlockPool.parts`: read them, never change them): what a
    dump stores (`snapshot.py`) and the invariants are checked over
    (`integrity.py`)."""

    ref_cnt: list[int]  # per block: block tables naming it
    fill: list[int]  # per block: slots holding a token
    block_hash: BlockHashes  # per block: its prefix hash (None: none)
    uncached_free: Sequence[int]  # free blocks holding nothing reusable, in hand-out order
    cached_free: Iterable[int]  # free blocks holding a hash, least recently freed first
    stamp: Sequence[int]  # per block: when it last joined the free queue (`clock` then)
    clock: int
    seqs: Mapping[str, SeqEntry]


class PoolState(Protocol):
    """What `integrity.py` and `snapshot.py` read of a pool (`BlockPool` is one)."""

    config: PoolConfig
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    index: PrefixIndex
    tiers: PoolTiers | None
    table_entries: int
    name_chars: int
    max_table_entries: int
    max_sequences: int
    max_name_chars: int
    prefix_queried_tokens: int  # prompt tokens admissions looked up
    prefix_hit_tokens: int  # ... found: in the KV pool, or a tier load issued (`TierStats`)
    evictions: int
    copies: int
    out_of_blocks: int

    def parts(self) -> PoolParts: ...

    def stats(self) -> PoolStats: ...

    def tables(self) -> dict[str, list[int]]: ...

    def free_order(self) -> list[int]: ...

    def refcounts(self) -> dict[int, int]: ...
