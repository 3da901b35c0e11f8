"""The KV event log: a bounded window of numbered events for WatchEvents.

Events are numbered in the order of the journal records that caused them,
so the same journal gives the same numbers after a restart. Each record
gets a `RecordEvents` when it takes its place in the global order (`begin`, under
the service's mutation lock); its events collect there without any locking
while the record is applied, possibly under its pool's lock only and at the
same time as another pool's record; `finish` numbers and publishes every
finished batch at the head of the queue, in the records' order. So a record
applied late never lets a later record's events jump ahead of it.
Readers (one thread per watcher) take only the log's own small lock.

Numbering costs O(batches), not O(events): a published batch keeps its
events as the tuples it collected (`Event`'s fields after its number, the
trailing defaults left out), under the number of its first one, and a
reader builds `Event`s from them outside the lock. (A 32k-token admit
stores 2,048 blocks: numbering them one by one under the log's lock made
every other pool's Step, which finishes its own batch, wait for it.)
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Sequence
from itertools import repeat
from typing import NamedTuple


class Event(NamedTuple):
    sequence: int
    kind: str  # one of KINDS
    pool_id: str
    block_id: int = 0
    block_hash: bytes = b""
    model_fingerprint: str = ""
    reason: str = ""
    # POOL_REGISTERED: what a router needs to reach the pool's worker.
    worker_id: str = ""
    advertise_url: str = ""
    served_model_name: str = ""


# Kinds beyond the core's block_stored / block_removed / all_cleared.
POOL_REGISTERED = "pool_registered"
POOL_DROPPED = "pool_dropped"


class RecordEvents:
    """The events of one journal record, unnumbered until `EventLog.finish`."""

    __slots__ = ("events", "done", "end")

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.done = False
        self.end: int | None = None  # once numbered: the number after its last event

    def add(
        self,
        kind: str,
        pool_id: str,
        block_id: int = 0,
        block_hash: bytes | None = None,
        model_fingerprint: str = "",
        reason: str = "",
        **registered: str,
    ) -> None:
        """`registered`: a POOL_REGISTERED event's worker_id, advertise_url, served_model_name."""
        self.events.append(
            (
                kind,
                pool_id,
                max(block_id, 0),
                block_hash or b"",
                model_fingerprint,
                reason,
                registered.get("worker_id", ""),
                registered.get("advertise_url", ""),
                registered.get("served_model_name", ""),
            )
        )

    def add_blocks(
        self, kind: str, pool_id: str, blocks: Sequence[int], hashes: Sequence[bytes]
    ) -> None:
        """A run of core events of one kind (block_stored, block_removed,
        all_cleared: block 0, hash b""), in order: `add` with no other
        field. NOTE: each kept as its first four fields (`Event`'s defaults
        are the rest), one short tuple per block a step stores or evicts,
        built at C speed (the hot path: a decode step stores a block per 16
        tokens)."""
        self.events += zip(repeat(kind), repeat(pool_id), blocks, hashes)


class EventLog:
    def __init__(self, retention: int) -> None:
        self._retention = retention
        # Published batches with events: the number of the first event of
        # each, and its events (never changed once published).
        self._starts: deque[int] = deque()
        self._batches: deque[list[tuple]] = deque()
        self._first = 1  # the oldest retained event's number (= _published when none is)
        self._queue: deque[RecordEvents] = deque()  # begun, in record order, not yet numbered
        self._cond = threading.Condition(threading.Lock())
        self.next_sequence = 1  # the number the next numbered event gets
        self._published = 1  # readers see events below this number
        self.closed = False

    def begin(self) -> RecordEvents:
        """The batch of the next record (the caller keeps records in order)."""
        batch = RecordEvents()
        with self._cond:
            self._queue.append(batch)
        return batch

    def finish(self, batch: RecordEvents) -> None:
        """`batch` is complete: number and publish every complete batch at the
        head of the queue (this one too once those before it are done)."""
        with self._cond:
            batch.done = True
            queue = self._queue
            if not queue or not queue[0].done:
                return
            seq = self.next_sequence
            while queue and queue[0].done:
                b = queue.popleft()
                if b.events:
                    self._starts.append(seq)
                    self._batches.append(b.events)
                    seq += len(b.events)
                    b.events = []
                b.end = seq
            self.next_sequence = self._published = seq
            self._trim()
            self._cond.notify_all()

    def _trim(self) -> None:
        """Keep the last `retention` events (lock held)."""
        self._first = max(self._first, self._published - self._retention)
        starts, batches = self._starts, self._batches
        while starts and starts[0] + len(batches[0]) <= self._first:
            starts.popleft()
            batches.popleft()

    def numbered(self, batch: RecordEvents, timeout: float) -> int | None:
        """The number after `batch`'s last event, once it is numbered (waits
        up to `timeout` s for the batches before it; None if they are not)."""
        with self._cond:
            if batch.end is None:
                self._cond.wait_for(lambda: batch.end is not None, timeout)
            return batch.end

    def reset(self, next_sequence: int) -> None:
        """Forget the window and any unfinished batch (the state was
        reloaded); numbering continues at `next_sequence`."""
        with self._cond:
            self._starts.clear()
            self._batches.clear()
            self._queue.clear()
            self.next_sequence = self._published = self._first = next_sequence
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    @property
    def published(self) -> int:
        """The number the next event visible to readers will have."""
        return self._published

    def read(self, cursor: int, limit: int, timeout: float) -> tuple[list[Event], int, bool]:
        """Events from sequence `cursor` on (at most `limit`), waiting up to
        `timeout` s for one. Returns (events, next cursor, gap) where gap is
        True when `cursor` is no longer retained (or lies beyond this log's
        history): the caller must resync, and the batch starts at the oldest
        retained event instead."""
        with self._cond:
            if self._published <= cursor and not self.closed:
                self._cond.wait(timeout)
            first = self._first
            gap = cursor < first or cursor > self._published
            if gap:
                cursor = first
            # The pieces to read, found under the lock; the Events are built after.
            pieces = []
            starts, batches = self._starts, self._batches
            i = max(bisect.bisect_right(starts, cursor) - 1, 0)
            at, left = cursor, limit
            while left > 0 and i < len(starts):
                start, events = starts[i], batches[i]
                lo = at - start
                if lo < len(events):
                    hi = min(len(events), lo + left)
                    pieces.append((start, events, lo, hi))
                    at += hi - lo
                    left -= hi - lo
                i += 1
        out = [
            Event(start + j, *events[j]) for start, events, lo, hi in pieces for j in range(lo, hi)
        ]
        return out, cursor + len(out), gap
