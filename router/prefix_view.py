"""The allocator's prefix-cache index, kept in the router from its events.

Built from a `WatchEvents` snapshot of every pool's cached blocks
(POOL_CACHED) and then every event numbered from before it: a block stored
(`h`) or removed, a pool cleared, registered or dropped. A prompt matches by
the allocator's own rule (`BlockPool.cached_blocks`: the leading hashes of
its chain some block of the pool holds).

- `synced` is false until a snapshot has ended, and from a stream break
  until the next one ends; meanwhile the router asks `MatchPrefix`.
- One thread (the discovery's) applies events; the event loop's reads. A
  snapshot is built aside and put in place whole, so a reader that saw
  `synced` reads a complete view, and readers see only whole dict
  operations (atomic under the GIL).

Why, and why it is exact: docs/architecture.md, "The router's rules, and why".
"""

from __future__ import annotations

from collections.abc import Sequence

from allocator_service.core.hashing import leading_hits
from allocator_service.wire.v1 import allocator_pb2 as pb

_STORED = pb.KV_EVENT_KIND_BLOCK_STORED
_REMOVED = pb.KV_EVENT_KIND_BLOCK_REMOVED
_CLEARED = pb.KV_EVENT_KIND_ALL_CLEARED
_REGISTERED = pb.KV_EVENT_KIND_POOL_REGISTERED
_DROPPED = pb.KV_EVENT_KIND_POOL_DROPPED
_SNAPSHOT_END = pb.KV_EVENT_KIND_SNAPSHOT_END
_POOL_CACHED = pb.KV_EVENT_KIND_POOL_CACHED
_BLOCKS_CHANGED = pb.KV_EVENT_KIND_BLOCKS_CHANGED


class _Pool:
    """One pool's blocks that hold a hash, and how many blocks hold each hash
    (two sequences may fill identical blocks before either is cached); its
    free blocks as last heard (None: not yet)."""

    __slots__ = ("hash_of", "holders", "free")

    def __init__(self, free: int | None = None) -> None:
        self.hash_of: dict[int, bytes] = {}
        self.holders: dict[bytes, int] = {}
        self.free = free

    def set(self, block: int, h: bytes | None) -> None:
        old = self.hash_of.get(block)
        if old == h:
            return
        if old is not None:
            n = self.holders[old] - 1
            if n:
                self.holders[old] = n
            else:
                del self.holders[old]
        if h is None:
            del self.hash_of[block]
        else:
            self.hash_of[block] = h
            self.holders[h] = self.holders.get(h, 0) + 1


class PrefixView:
    """Every pool's cached block hashes, as the allocator's events say."""

    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}  # what readers read (complete once `synced`)
        self._applying: dict[str, _Pool] = self._pools  # where events go (a snapshot being built)
        self.synced = False
        self.snapshots = 0  # snapshots completed (each (re)connection takes one)

    def begin(self) -> None:
        """A new snapshot follows: built aside, not in step until it ends."""
        self.synced = False
        self._applying = {}

    def lost(self) -> None:
        """The stream broke: not in step until a new snapshot ends."""
        self.synced = False

    def apply(self, event: pb.KvEvent) -> None:
        """One event of the stream, in order (others' kinds are ignored)."""
        kind = event.kind
        pools = self._applying
        if kind == _STORED:
            pool = _pool(pools, event.pool_id)
            pool.set(event.block_id, event.block_hash)
        elif kind == _REMOVED:
            pool = _pool(pools, event.pool_id)
            pool.set(event.block_id, None)
        elif kind == _CLEARED:  # the hashes go; the blocks stay as free as they were
            old = pools.get(event.pool_id)
            pools[event.pool_id] = _Pool(old.free if old is not None else None)
            return
        elif kind == _REGISTERED:  # a registered pool starts with nothing cached
            pools[event.pool_id] = _Pool()
            return
        elif kind == _BLOCKS_CHANGED:
            # a run of stored/removed events of one pool (a packed stream)
            pool = _pool(pools, event.pool_id)
            hashes, removed = event.block_hashes, event.removed
            for i, block in enumerate(event.block_ids):
                pool.set(block, None if removed[i] else hashes[32 * i : 32 * i + 32])
        elif kind == _POOL_CACHED:
            pool = _pool(pools, event.pool_id)
            hashes = event.block_hashes
            for i, block in enumerate(event.block_ids):
                pool.set(block, hashes[32 * i : 32 * i + 32])
        elif kind == _DROPPED:
            pools.pop(event.pool_id, None)
            return
        elif kind == _SNAPSHOT_END:
            self._pools = pools
            self.snapshots += 1
            self.synced = True
            return
        else:
            return
        if event.HasField("free_blocks"):
            # a packed stream's and a snapshot's block events carry it
            pool.free = event.free_blocks

    def note_free(self, pool_id: str, free: int) -> None:
        """A pool's free blocks from a listing (the later of it and the last
        event's figure stands); a pool the view does not hold is not added."""
        pool = self._applying.get(pool_id)
        if pool is not None:
            pool.free = free

    def free_blocks(self, pool_id: str) -> int | None:
        """The pool's free blocks as last heard (an event or a listing), None if not heard."""
        pool = self._pools.get(pool_id)
        return pool.free if pool is not None else None

    def cached_blocks(self, pool_id: str, hashes: Sequence[bytes]) -> int:
        """How many of `hashes` (a prompt's chain from the pool's root), from
        the first, some block of the pool holds: `BlockPool.cached_blocks`."""
        pool = self._pools.get(pool_id)
        return leading_hits(hashes, pool.holders) if pool is not None else 0

    def holds(self, pool_id: str, h: bytes) -> bool:
        """Whether some block of the pool holds the hash `h`."""
        pool = self._pools.get(pool_id)
        return pool is not None and h in pool.holders

    def held_blocks(self, pool_id: str) -> int:
        """How many of the pool's blocks hold a cached hash (in use or free)."""
        pool = self._pools.get(pool_id)
        return len(pool.hash_of) if pool is not None else 0

    def blocks(self, pool_id: str) -> dict[int, bytes]:
        """block -> hash of one pool (tests and debugging)."""
        pool = self._pools.get(pool_id)
        return dict(pool.hash_of) if pool is not None else {}


def _pool(pools: dict[str, _Pool], pool_id: str) -> _Pool:
    pool = pools.get(pool_id)
    if pool is None:
        pool = pools[pool_id] = _Pool()
    return pool
