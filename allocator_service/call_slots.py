"""Unary calls in flight, per pool: one worker cannot take every server thread.

The server answers unary calls on a fixed pool of threads (`server.py`). A
pool's long calls (integrity checks, dumps of a large pool) are legal, and
the fair share (`fairshare.py`) even makes a heavy pool's calls wait while
lighter pools run, each waiting call holding its thread. Without a bound, one
worker that sends many such calls at once holds every thread, and every other
pool's calls queue behind them. So each pool (for RegisterPool: each worker
id) may have at most `Limits.max_calls_per_pool` unary calls in flight; one
more is refused at once with RESOURCE_EXHAUSTED (`pool_calls`), before any
work, and nothing changes. A worker's own client never comes near it: its
steps go over its step stream, its heartbeats are not counted, and the rest
(stats for its metrics, a block table) are one or two at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from allocator_service.errors import TooManyCalls


class CallSlots:
    def __init__(self, per_tenant: int) -> None:
        if per_tenant < 1:
            raise ValueError("per_tenant must be positive")
        self.per_tenant = per_tenant
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self.refused = 0  # calls refused so far (metrics)

    @contextmanager
    def take(self, tenant: str) -> Iterator[None]:
        """Hold one of `tenant`'s slots for the call; TooManyCalls when none is free."""
        with self._lock:
            n = self._in_flight.get(tenant, 0)
            if n >= self.per_tenant:
                self.refused += 1
                raise TooManyCalls(f"{n} calls of this pool are in flight, the most one pool may have "
                                   "at once: wait for one to be answered")
            self._in_flight[tenant] = n + 1
        try:
            yield
        finally:
            with self._lock:
                n = self._in_flight[tenant] - 1
                if n:
                    self._in_flight[tenant] = n
                else:
                    del self._in_flight[tenant]

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)
