"""Per block of a pool: the prefix hash it holds, or none.

NOTE: a column, not a list of `bytes`: the hashes side by side (`data`,
`HASH_BYTES` a block) and, as 64-bit integers, each one's `key`: `~hash(h)`,
never 0 since `hash()` never returns -1, so 0 (`NO_HASH`) marks a block
holding none. A 32-byte `bytes` object takes 80 bytes of memory and its list
entry 8; the column takes 40 a block, and only for blocks that held a hash:
both are anonymous memory maps, whose pages take memory once written. The
prefix index (`prefix_index.py`) probes `keys`, compares `data` and finds a
hash's slot from its key; a sequence reads its hash chain from its blocks'
hashes (`SeqEntry.chain`). A hash read back (`self[b]`) is a new `bytes`.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

# Bytes of a block hash: a SHA-256 digest (`hashing.py`).
HASH_BYTES = 32
# The key of a block holding no hash (a key is `~hash(h)`: `hash()` never returns -1).
NO_HASH = 0


def key_of(h: bytes) -> int:
    """The key of hash `h` in `BlockHashes.keys` (never `NO_HASH`)."""
    return ~hash(h)


# Blocks read at once where every block is read: no list of them all.
_PIECE = 4096


def _zeros(n: int) -> mmap.mmap:
    """`n` zero bytes that take memory only once written."""
    return mmap.mmap(-1, max(n, 1))


class BlockHashes(Sequence[bytes | None]):
    """`self[b]`: the hash block `b` holds (None: nothing reusable). Only
    the prefix index writes it (`set`, `drop`, `drop_all`; `register` and
    `evict` inline the first two)."""

    __slots__ = ("_n", "data", "keys")

    def __init__(self, n: int) -> None:
        self._n = n
        self.data = _zeros(HASH_BYTES * n)  # block b's hash: data[32 b : 32 (b + 1)]
        self.keys = memoryview(_zeros(8 * n)).cast("q")[:n]  # block b's hash's key

    @classmethod
    def of(cls, hashes: Sequence[bytes | None]) -> BlockHashes:
        """A column holding `hashes` (one entry per block); ValueError if
        one is not `HASH_BYTES` long (a dump or snapshot that is not ours)."""
        column = cls(len(hashes))
        for b, h in enumerate(hashes):
            if h is not None:
                if len(h) != HASH_BYTES:
                    raise ValueError(
                        f"block {b}'s hash has {len(h)} bytes; a block hash has {HASH_BYTES}"
                    )
                column.set(b, h)
        return column

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, b: int) -> bytes | None: ...

    @overload
    def __getitem__(self, b: slice) -> list[bytes | None]: ...

    def __getitem__(self, b: int | slice) -> bytes | None | list[bytes | None]:
        if isinstance(b, slice):
            lo, hi, step = b.indices(self._n)
            if step != 1:
                return [self[i] for i in range(lo, hi, step)]
            raw = self.data[lo * HASH_BYTES : hi * HASH_BYTES]  # one copy, cut below
            hashes = [raw[o : o + HASH_BYTES] for o in range(0, len(raw), HASH_BYTES)]
            return [
                h if key != NO_HASH else None
                for key, h in zip(self.keys[lo:hi].tolist(), hashes, strict=True)
            ]
        if self.keys[b] == NO_HASH:
            return None
        o = b * HASH_BYTES
        return self.data[o : o + HASH_BYTES]

    def __iter__(self) -> Iterator[bytes | None]:
        for lo in range(0, self._n, _PIECE):
            yield from self[lo : lo + _PIECE]

    def copy(self) -> BlockHashes:
        """A copy of the column (two memory copies: quick to take under a
        pool's lock, to read after)."""
        column = BlockHashes(self._n)
        column.data[:] = self.data
        column.keys[:] = self.keys
        return column

    def at(self, blocks: Iterable[int]) -> list[bytes | None]:
        """The hashes `blocks` hold, in order (`self[b]` for each)."""
        data, keys = self.data, self.keys
        return [
            None if keys[b] == NO_HASH else data[(o := b * HASH_BYTES) : o + HASH_BYTES]
            for b in blocks
        ]

    def holds(self, b: int) -> bool:
        """Whether block `b` holds a hash."""
        return self.keys[b] != NO_HASH

    def holds_hash(self, b: int, h: bytes) -> bool:
        """Whether block `b` holds exactly `h`."""
        o = b * HASH_BYTES
        return self.keys[b] == key_of(h) and self.data[o : o + HASH_BYTES] == h

    def num_held(self) -> int:
        """How many blocks hold a hash."""
        keys = self.keys
        return self._n - sum(
            keys[i : i + _PIECE].tolist().count(NO_HASH) for i in range(0, self._n, _PIECE)
        )

    def held(self) -> Iterable[int]:
        """The blocks holding a hash, in id order."""
        return (b for b, key in enumerate(self.keys) if key != NO_HASH)

    def set(self, b: int, h: bytes) -> None:
        """Block `b` now holds `h` (IndexError, nothing changed, unless it
        has `HASH_BYTES`: a memory map's slice keeps its size)."""
        o = b * HASH_BYTES
        self.data[o : o + HASH_BYTES] = h
        self.keys[b] = key_of(h)

    def drop(self, b: int) -> None:
        """Block `b` holds no hash any more."""
        self.keys[b] = NO_HASH

    def drop_all(self) -> None:
        """No block holds a hash any more."""
        self.keys.cast("B")[:] = bytes(8 * self._n)
