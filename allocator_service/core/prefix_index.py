"""The prefix cache's index: block hash -> the blocks holding that hash.

Several blocks can hold one hash (two sequences filled the same block before
either was cached). The index knows which hash each block holds, picks the
block an admission shares, and tells the event sink what it stores and
removes; the `BlockPool` decides when (it owns refcounts and free queues).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from allocator_service.core.block_ids import block_ids

# Event kinds passed to the optional event sink (the service turns them into
# the KV event stream a router can follow).
BLOCK_STORED = "block_stored"
BLOCK_REMOVED = "block_removed"
ALL_CLEARED = "all_cleared"

EventSink = Callable[[str, int, bytes | None], None]


class PrefixIndex:
    """`block_hash[b]` is the hash block `b` holds (None: nothing reusable);
    every hash maps to the blocks holding it, in registration order.

    NOTE: a hash held by one block (nearly every hash) maps to that block's
    id itself, and only a hash held by several to a dict of them: a dict per
    hash cost ~200 bytes a cached block."""

    __slots__ = ("block_hash", "_holders", "event_sink")

    def __init__(self, block_hash: list[bytes | None], event_sink: EventSink | None = None) -> None:
        """An index over `block_hash` (one entry per block; all None for a
        fresh pool, a restored dump's hashes otherwise). No events."""
        self.block_hash = block_hash
        self._holders: dict[bytes, int | dict[int, None]] = {}
        for b, h in zip(block_ids(len(block_hash)), block_hash, strict=False):
            if h is not None:
                self._add(b, h)
        self.event_sink = event_sink

    def _add(self, b: int, h: bytes) -> None:
        holders = self._holders.get(h)
        if holders is None:
            self._holders[h] = b
        elif type(holders) is int:
            if holders != b:
                self._holders[h] = {holders: None, b: None}
        else:
            holders[b] = None

    def __contains__(self, h: bytes) -> bool:
        return h in self._holders

    def entries(self) -> Iterator[tuple[bytes, list[int]]]:
        """(hash, its holders) for every indexed hash (integrity checks)."""
        for h, holders in self._holders.items():
            yield h, [holders] if type(holders) is int else list(holders)

    def pick(self, h: bytes, ref_cnt: Sequence[int], stamp: Sequence[int]) -> int | None:
        """The block an admission shares for hash `h` (None: not cached): one
        in use if any (the lowest id), else the free one queued last."""
        holders = self._holders.get(h)
        if holders is None or type(holders) is int:
            return holders
        in_use = [b for b in holders if ref_cnt[b] > 0]
        if in_use:
            return min(in_use)
        return max(holders, key=stamp.__getitem__)

    def register(self, b: int, h: bytes) -> None:
        """Block `b` now holds the full block hashed `h`."""
        self.block_hash[b] = h
        self._add(b, h)
        if self.event_sink is not None:
            self.event_sink(BLOCK_STORED, b, h)

    def evict(self, b: int) -> None:
        """Forget the hash block `b` holds (it is about to be reused)."""
        h = self.block_hash[b]
        assert h is not None
        holders = self._holders[h]
        if type(holders) is int:
            del self._holders[h]
        else:
            del holders[b]
            if len(holders) <= 1:
                if holders:
                    self._holders[h] = next(iter(holders))
                else:
                    del self._holders[h]
        self.block_hash[b] = None
        if self.event_sink is not None:
            self.event_sink(BLOCK_REMOVED, b, h)

    def clear(self) -> int:
        """Forget every hash; returns how many blocks held one."""
        dropped = 0
        for blocks in self._holders.values():
            if type(blocks) is int:
                blocks = (blocks,)
            dropped += len(blocks)
            for b in blocks:
                self.block_hash[b] = None
        self._holders.clear()
        if self.event_sink is not None:
            self.event_sink(ALL_CLEARED, -1, None)
        return dropped
