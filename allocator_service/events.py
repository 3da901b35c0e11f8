"""The KV event log: a bounded window of numbered events for WatchEvents.

Events are appended by the state machine (under the service lock) in the
order state changes are applied, so the same journal gives the same numbers
after a restart. They collect in a pending list without any locking (a
prefix-cached decode step can store dozens of blocks) and `publish()` moves
them to the readers' window once per change, under the log's own small lock.
Readers (one thread per watcher) never touch the service lock.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import NamedTuple


class Event(NamedTuple):
    sequence: int
    kind: str  # one of KINDS
    pool_id: str
    block_id: int = 0
    block_hash: bytes = b""
    model_fingerprint: str = ""
    reason: str = ""


# Kinds beyond the core's block_stored / block_removed / all_cleared.
POOL_REGISTERED = "pool_registered"
POOL_DROPPED = "pool_dropped"


class EventLog:
    def __init__(self, retention: int) -> None:
        self._events: deque[Event] = deque(maxlen=retention)
        self._pending: list[Event] = []
        self._cond = threading.Condition(threading.Lock())
        self.next_sequence = 1  # the number the next appended event gets
        self._published = 1  # readers see events below this number
        self.closed = False

    def append(
        self,
        kind: str,
        pool_id: str,
        block_id: int = 0,
        block_hash: bytes | None = None,
        model_fingerprint: str = "",
        reason: str = "",
    ) -> None:
        seq = self.next_sequence
        self.next_sequence = seq + 1
        self._pending.append(
            Event(seq, kind, pool_id, max(block_id, 0), block_hash or b"", model_fingerprint, reason)
        )

    def publish(self) -> None:
        """Make the pending events visible and wake the watchers."""
        if not self._pending:
            return
        with self._cond:
            self._events.extend(self._pending)
            self._published = self.next_sequence
            self._cond.notify_all()
        self._pending = []

    def reset(self, next_sequence: int) -> None:
        """Forget the window (the state was reloaded); numbering continues at
        `next_sequence`."""
        with self._cond:
            self._events.clear()
            self._pending = []
            self.next_sequence = self._published = next_sequence
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
            first = self._events[0].sequence if self._events else self._published
            gap = cursor < first or cursor > self._published
            if gap:
                cursor = first
            batch = list(itertools.islice(self._events, cursor - first, cursor - first + limit))
        return batch, cursor + len(batch), gap
