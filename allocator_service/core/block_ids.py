"""Block ids as int objects every pool shares.

An int past 256 is an object of 32 bytes, and a pool names each of its
blocks in its free queue, its tables and its prefix index: one object per
block per pool. Every pool's block b is the same number, so the pools of one
process take their ids from one list, grown to the largest pool: a fleet of
pools of N blocks keeps N id objects, not N per pool.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

_ids: list[int] = []
_grow = threading.Lock()


def block_ids(n: int) -> list[int]:
    """The shared list of ids, at least `n` long (read only: never change it)."""
    if len(_ids) < n:
        with _grow:
            if len(_ids) < n:
                _ids.extend(range(len(_ids), n))
    return _ids


def shared(ids: list[int], blocks: Iterable[int]) -> list[int]:
    """`blocks` as the shared objects of `ids`; an id out of its range (a
    damaged dump, which the integrity checks report) is kept as it is."""
    n = len(ids)
    return [ids[b] if type(b) is int and 0 <= b < n else b for b in blocks]
