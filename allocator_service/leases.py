"""Pool leases: the deadline by which each pool must be renewed.

Deadlines live only in memory and on the monotonic clock: they are not part
of the durable state (a restart re-arms every lease from the restart time,
so a worker gets a full TTL to find the new server). What IS durable is the
decision to drop a pool, which the service journals like any other change.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LeaseTable:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._deadline: dict[str, float] = {}

    def renew(self, pool_id: str) -> None:
        self._deadline[pool_id] = self._clock() + self.ttl_s

    def forget(self, pool_id: str) -> None:
        self._deadline.pop(pool_id, None)

    def rearm(self, pool_ids: list[str]) -> None:
        """Keep the deadlines of pools still present, give new ones a full TTL
        and forget the rest (after a reload of the state)."""
        now = self._clock()
        self._deadline = {p: self._deadline.get(p, now + self.ttl_s) for p in pool_ids}

    def expired(self) -> list[str]:
        now = self._clock()
        return [p for p, d in self._deadline.items() if d <= now]

    def remaining(self, pool_id: str) -> float:
        return max(self._deadline.get(pool_id, 0.0) - self._clock(), 0.0)
