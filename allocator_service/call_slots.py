"""A pool's slow calls in flight: one worker cannot take every server thread.

The server answers unary calls on a fixed pool of threads (`rpc/server.py`). A
pool's reads can be long and are legal (integrity checks, dumps of a large
pool), and the fair share (`fairshare.py`) even makes a heavy pool's calls
wait while lighter pools run, each waiting call holding its thread. Without
a bound, one worker that sends many such calls at once holds every thread,
and every other pool's calls queue behind them. So a pool may have at most
`Limits.max_calls_per_pool` of them in flight (GetBlockTable, GetPoolStats,
ResetPrefixCache, DumpPool: `servicer.SLOTTED`); one more is refused at once
with RESOURCE_EXHAUSTED (`pool_calls`), before any work, and nothing
changes. Only calls with the pool's credential take a slot (it is checked
first), so nobody can use up another pool's slots. The gRPC client backs
off and retries a `pool_calls` refusal like an unreachable server, so a
worker's own burst (its /metrics scraped by several at once) waits rather
than fails. What this bounds is one pool: many pools' slow calls together
can still fill the server's threads.
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
        self.refused = 0  # calls refused so far (`pagedkv_allocator_pool_calls_refused_total`)

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
