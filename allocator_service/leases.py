"""Pool leases: the deadline by which each pool must be renewed.

Deadlines live only in memory and on the monotonic clock: they are not part
of the durable state (a restart re-arms every lease from the restart time,
so a worker gets a full TTL to find the new server). What IS durable is the
decision to drop a pool, which the service journals like any other change.

The table has its own small lock, so a heartbeat renews without waiting for
any pool's work. A lease never runs out because the allocator itself could
not serve: the reaper calls `extend` with the time the process did not run
(a pause, SIGSTOP, a stalled interpreter), so every deadline moves on by it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class LeaseTable:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._deadline: dict[str, float] = {}
        self._lock = threading.Lock()

    def arm(self, pool_id: str) -> None:
        """A new pool's lease: a full TTL from now."""
        with self._lock:
            self._deadline[pool_id] = self._clock() + self.ttl_s

    def renew(self, pool_id: str) -> None:
        """A full TTL from now for a pool that has a lease (a dropped pool's
        lease is not brought back by a call that raced with its drop)."""
        with self._lock:
            if pool_id in self._deadline:
                self._deadline[pool_id] = self._clock() + self.ttl_s

    def forget(self, pool_id: str) -> None:
        with self._lock:
            self._deadline.pop(pool_id, None)

    def rearm(self, pool_ids: list[str]) -> None:
        """Keep the deadlines of pools still present, give new ones a full TTL
        and forget the rest (after a reload of the state)."""
        with self._lock:
            now = self._clock()
            self._deadline = {p: self._deadline.get(p, now + self.ttl_s) for p in pool_ids}

    def extend(self, seconds: float) -> None:
        """Move every deadline on by `seconds` (the allocator did not run)."""
        with self._lock:
            for p in self._deadline:
                self._deadline[p] += seconds

    def expired(self) -> list[str]:
        with self._lock:
            now = self._clock()
            return [p for p, d in self._deadline.items() if d <= now]

    def is_expired(self, pool_id: str) -> bool:
        with self._lock:
            d = self._deadline.get(pool_id)
            return d is not None and d <= self._clock()

    def remaining(self, pool_id: str) -> float:
        with self._lock:
            return max(self._deadline.get(pool_id, 0.0) - self._clock(), 0.0)
