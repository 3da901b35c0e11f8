"""The long-lived calls the server counts: event watchers (WatchEvents and
the HTTP port's live view) and StepStreams, each within its limit, and the
end of every StepStream at shutdown."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from allocator_service.config import Limits
from allocator_service.wire.errors import CapacityExceeded, ShuttingDown, StepStreamsExhausted


class Streams:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._watchers = {False: 0, True: 0}  # others', the router role's
        self._step_streams: set[Callable[[], Any]] = set()  # each open StepStream's end()
        self._ended = False

    def open_watcher(self, router: bool = False) -> None:
        """Count an event stream in: a router's (`router`: a caller with the
        router token) within `max_router_watchers`, any other's within
        `max_watchers`, so no other caller can take a router's place."""
        limit = self.limits.max_router_watchers if router else self.limits.max_watchers
        with self._lock:
            if self._watchers[router] >= limit:
                raise CapacityExceeded(
                    f"the server serves at most {limit} event streams"
                    + (" to routers" if router else " to callers other than routers")
                )
            self._watchers[router] += 1

    def close_watcher(self, router: bool = False) -> None:
        with self._lock:
            self._watchers[router] -= 1

    def open_step_stream(self, end: Callable[[], Any]) -> None:
        """Count a StepStream in (`end()` ends it: `end_step_streams`)."""
        with self._lock:
            if self._ended:
                raise ShuttingDown("the allocator is shutting down")
            if len(self._step_streams) >= self.limits.max_step_streams:
                raise StepStreamsExhausted(
                    f"the server serves at most {self.limits.max_step_streams} step streams: "
                    "send unary Steps"
                )
            self._step_streams.add(end)

    def close_step_stream(self, end: Callable[[], Any]) -> None:
        with self._lock:
            self._step_streams.discard(end)

    def end_step_streams(self) -> None:
        """At shutdown: end every open StepStream (an idle one now: it waits
        for its worker's next step and would hold the shutdown for its
        grace; a busy one once its step is answered) and refuse new ones."""
        with self._lock:
            self._ended = True
            ends = list(self._step_streams)
        for end in ends:
            end()
