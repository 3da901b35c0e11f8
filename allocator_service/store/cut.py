"""A snapshot's cut and its size bound (`durable.py` takes and writes it).

A snapshot is taken off the hot path:

- under the mutation lock, `DurableState.changed` only notes the cut: the record index
  and chain digest it includes, an empty event batch whose number will be
  the snapshot's `next_event`, and the pools present, each marked due;
- a background thread (or, before `start`, the caller right after its
  change) then serialises the pools one at a time, each under its own lock,
  while other records are applied; whoever applies a record with a later
  index to a pool still due serialises it first (`settle`), so every pool
  is taken exactly as of the cut: a consistent cut without stopping the world;
  the shared KV store's index likewise (`settle_store`: whoever changes it
  first after the cut, under the mutation lock, takes it first);
- the store then replaces the snapshot and trims exactly the journal
  records the snapshot includes, found by the cut record's chain digest
  (`RedisJournal.write_snapshot`), while records after the cut stay: replay
  from the new snapshot gives the same state, event numbers and answers.

A pool's part is its packed dump (`core.snapshot.to_packed`), whose size is
bounded by the pool's shape (blocks, sequences, their names), never by the
sum of its table lengths. A snapshot over the size bound
(`ServiceConfig.max_snapshot_bytes`, never more than Redis's 512 MB value
limit) cannot be written; then no pool may hold the others' snapshot up:
each pool's share of the bound is in proportion to its blocks, and pools
whose part is over their share are dropped loudly, largest excess first (reason
`snapshot_too_large`: its worker gets NOT_FOUND, re-registers and
recomputes), until what is left fits; the next cut follows at once, so the
journal is trimmed as usual (`drop_pools`, set by the service). A snapshot
whose cut the store no longer holds is not written either and the next try
backs off like a failed write; the journal still holds every record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from allocator_service.store.events import RecordEvents
from allocator_service.store.registry import PoolEntry

# Redis refuses a value (and a script argument) over 512 MB.
REDIS_MAX_VALUE_BYTES = 512 << 20
# The reason a pool is dropped with when its part keeps a snapshot over the bound.
SNAPSHOT_TOO_LARGE = "snapshot_too_large"


def over_share(sizes: dict[str, int], blocks: dict[str, int], room: int) -> list[str]:
    """The pools to drop so that their parts (`sizes`, bytes) fit in `room`:
    none if they fit already, else pools whose part is over its share of
    `room` (in proportion to its `blocks`), largest excess first, until what
    is left fits (the shares sum to `room`, so it always does)."""
    left = sum(sizes.values())
    total = sum(blocks.values()) or 1
    excess = {p: size - room * blocks[p] // total for p, size in sizes.items()}
    drop = []
    for p in sorted((p for p, x in excess.items() if x > 0), key=lambda p: -excess[p]):
        if left <= room:
            break
        drop.append(p)
        left -= sizes[p]
    return drop


@dataclass(eq=False)
class Cut:
    """A snapshot being taken: the registry as of record `index`."""

    index: int
    chain: bytes
    header: dict[str, Any]
    marker: RecordEvents  # numbered once every record up to `index` published its events
    entries: list[PoolEntry]
    generation: int
    hint: int  # journal entries the snapshot includes, if nothing was missed
    parts: dict[str, str] = field(default_factory=dict)  # pool id -> its JSON
    store_due: bool = True  # the shared store's index is still to be taken
    store: dict[str, Any] | None = None  # ... as of the cut (`Registry.store_state`)
