"""The prefix cache's index: block hash -> the blocks holding that hash.

Several blocks can hold one hash (two sequences filled the same block before
either was cached). The index knows which hash each block holds, picks the
block an admission shares, and tells the event sink what it stores and
removes; the `BlockPool` decides when (it owns refcounts and free queues).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence

from mypy_extensions import mypyc_attr

from allocator_service.core.block_hashes import HASH_BYTES, NO_HASH, BlockHashes

# Event kinds passed to the optional event sink (the service turns them into
# the KV event stream a router can follow).
BLOCK_STORED = "block_stored"
BLOCK_REMOVED = "block_removed"
ALL_CLEARED = "all_cleared"

# Called with a run of events of one kind, in order: (kind, the blocks, their
# hashes); ALL_CLEARED names none: block 0 and an empty hash.
EventSink = Callable[[str, Sequence[int], Sequence[bytes]], None]

# An empty slot of the index's table.
EMPTY = -1


@mypyc_attr(allow_interpreted_subclasses=True)
class PrefixIndex:
    """`block_hash[b]` is the hash block `b` holds (None: nothing reusable);
    every hash maps to the blocks holding it.

    NOTE: the map is an open-addressing table of block ids (an array, 4
    bytes a slot, at least twice the pool's blocks: at most half full), not
    a dict: a block's slot is found from its hash's key (`block_hashes.key_of`, inlined
    as `~hash(h)`; `block_hash.keys` holds each block's) by linear probing,
    and a probe compares keys before hashes. A dict cost 40 bytes a cached
    block, and an int object of 32 for each id it held."""

    __slots__ = ("block_hash", "_data", "_keys", "_slots", "_mask", "event_sink")

    def __init__(self, num_blocks: int, event_sink: EventSink | None = None) -> None:
        """An empty index of a pool of `num_blocks` blocks."""
        self._column(BlockHashes(num_blocks))
        size = 8
        while size < 2 * num_blocks:
            size *= 2
        self._slots = array("i", [EMPTY]) * size
        self._mask = size - 1
        self.event_sink = event_sink

    @classmethod
    def over(cls, block_hash: BlockHashes, event_sink: EventSink | None = None) -> PrefixIndex:
        """An index of the hashes `block_hash` holds (a restored dump's). No events."""
        index = cls(len(block_hash), event_sink)
        index._column(block_hash)
        for b in block_hash.held():
            index._add(b)
        return index

    def _column(self, block_hash: BlockHashes) -> None:
        self.block_hash = block_hash
        self._data, self._keys = block_hash.data, block_hash.keys  # read once a lookup

    def _add(self, b: int) -> None:
        slots, mask = self._slots, self._mask
        i = self._keys[b] & mask
        while (s := slots[i]) != EMPTY:
            if s == b:
                return
            i = (i + 1) & mask
        slots[i] = b

    def holders(self, h: bytes) -> list[int]:
        """The blocks holding `h`, in the table's order."""
        slots, mask = self._slots, self._mask
        keys, data = self._keys, self._data
        found = []
        i = (key := ~hash(h)) & mask
        while (b := slots[i]) != EMPTY:
            if keys[b] == key and data[(o := b * HASH_BYTES) : o + HASH_BYTES] == h:
                found.append(b)
            i = (i + 1) & mask
        return found

    def __contains__(self, h: bytes) -> bool:
        slots, mask = self._slots, self._mask
        keys, data = self._keys, self._data
        i = (key := ~hash(h)) & mask
        while (b := slots[i]) != EMPTY:
            if keys[b] == key and data[(o := b * HASH_BYTES) : o + HASH_BYTES] == h:
                return True
            i = (i + 1) & mask
        return False

    def leading_hits(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, are indexed: the rule of
        `hashing.leading_hits`, its lookups inlined in one call."""
        slots, mask = self._slots, self._mask
        keys, data = self._keys, self._data
        hits = 0
        for h in hashes:
            i = (key := ~hash(h)) & mask
            while (b := slots[i]) != EMPTY:
                if keys[b] == key and data[(o := b * HASH_BYTES) : o + HASH_BYTES] == h:
                    break
                i = (i + 1) & mask
            else:
                return hits
            hits += 1
        return hits

    def entries(self) -> Iterator[tuple[bytes, list[int]]]:
        """(hash, the blocks found holding it) for every indexed hash
        (integrity checks: a block whose slot its hash does not reach is
        missing from them)."""
        seen: set[bytes] = set()
        for b in self._slots:
            if b != EMPTY and (h := self.block_hash[b]) is not None and h not in seen:
                seen.add(h)
                yield h, self.holders(h)

    def pick(self, h: bytes, ref_cnt: Sequence[int], stamp: Sequence[int]) -> int | None:
        """The block an admission shares for hash `h` (None: not cached): one
        in use if any (the lowest id), else the free one queued last."""
        slots, mask = self._slots, self._mask
        keys, data = self._keys, self._data
        i = (key := ~hash(h)) & mask
        while (b := slots[i]) != EMPTY and not (
            keys[b] == key and data[(o := b * HASH_BYTES) : o + HASH_BYTES] == h
        ):
            i = (i + 1) & mask
        if b == EMPTY:
            return None
        several = None
        while (s := slots[i := (i + 1) & mask]) != EMPTY:
            if keys[s] == key and data[(o := s * HASH_BYTES) : o + HASH_BYTES] == h:
                several = [b, s] if several is None else [*several, s]
        if several is None:
            return b
        in_use = [b for b in several if ref_cnt[b] > 0]
        if in_use:
            return min(in_use)
        return max(several, key=stamp.__getitem__)

    def register(self, b: int, h: bytes) -> None:
        """Block `b` now holds the full block hashed `h`."""
        self.register_run((b,), (h,))

    def register_run(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Each block of `blocks` now holds the full block hashed as the
        same entry of `hashes`, in order (an admission's blocks, those a
        decode fills). NOTE: `BlockHashes.set` and `_add` inlined: one call
        a prompt, not three a block."""
        data, keys, slots, mask = self._data, self._keys, self._slots, self._mask
        sink = self.event_sink
        for b, h in zip(blocks, hashes, strict=True):
            o = b * HASH_BYTES
            data[o : o + HASH_BYTES] = h
            key = keys[b] = ~hash(h)
            i = key & mask
            while (s := slots[i]) != EMPTY:
                if s == b:
                    break
                i = (i + 1) & mask
            else:
                slots[i] = b
        if sink is not None:
            sink(BLOCK_STORED, blocks, hashes)

    def evict(self, b: int) -> bytes:
        """Forget the hash block `b` holds (it is about to be reused); returns it."""
        return self.evict_run((b,))[0]

    def evict_run(self, blocks: Sequence[int]) -> list[bytes]:
        """Forget the hash each of `blocks` holds, in order (blocks about to
        be reused: an admission's evictions); returns them. NOTE: one call a
        run of evictions, not one a block (the admissions of a full cache)."""
        slots, mask, keys, data = self._slots, self._mask, self._keys, self._data
        sink = self.event_sink
        out: list[bytes] = []
        for b in blocks:
            key = keys[b]
            assert key != NO_HASH
            h = data[(o := b * HASH_BYTES) : o + HASH_BYTES]
            i = key & mask
            while (s := slots[i]) != b:
                if s == EMPTY:
                    raise KeyError(f"block {b} is not in the prefix index")
                i = (i + 1) & mask
            # Backward-shift deletion: move up each later entry of the run that
            # its own hash's probe reaches past the hole, so none is cut off.
            j = i
            while (s := slots[j := (j + 1) & mask]) != EMPTY:
                home = keys[s] & mask
                if (j - home) & mask >= (j - i) & mask:
                    slots[i] = s
                    i = j
            slots[i] = EMPTY
            keys[b] = NO_HASH  # `BlockHashes.drop`, inlined
            out.append(h)
        if sink is not None:
            sink(BLOCK_REMOVED, blocks, out)
        return out

    def clear(self) -> int:
        """Forget every hash; returns how many blocks held one."""
        dropped = self.block_hash.num_held()
        self.block_hash.drop_all()
        self._slots = array("i", [EMPTY]) * len(self._slots)
        if self.event_sink is not None:
            self.event_sink(ALL_CLEARED, (0,), (b"",))
        return dropped
