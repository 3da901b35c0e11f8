"""How busy the device was: `pagedkv_worker_device_busy_ratio`.

`BusyMeter.record(start, end)` takes one stretch of device work on the
engine's clock: a simulated step's interval on its stream, a CUDA step's
time between its two events (ending when its outputs were read), the CPU's
forward pass. `ratio()` is the share of the last `window_s` seconds (of the
engine's clock) the device computed; `busy_total` sums every stretch, so a
caller can take the ratio over a span of its own.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

__all__ = ["BUSY_WINDOW_S", "BusyMeter"]

BUSY_WINDOW_S = 10.0


class BusyMeter:
    def __init__(self, clock: Callable[[], float], window_s: float = BUSY_WINDOW_S) -> None:
        self._clock = clock
        self.window_s = window_s
        self._spans: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()
        self.busy_total = 0.0
        self.started = clock()

    def record(self, start: float, end: float) -> None:
        if end <= start:
            return
        with self._lock:
            self._spans.append((start, end))
            self.busy_total += end - start
            horizon = end - self.window_s
            while self._spans and self._spans[0][1] < horizon:
                self._spans.popleft()

    def ratio(self) -> float:
        """Device time / clock time over the last window (since the start, if shorter)."""
        now = self._clock()
        lo = max(now - self.window_s, self.started)
        if now <= lo:
            return 0.0
        with self._lock:
            busy = sum(max(0.0, min(e, now) - max(s, lo)) for s, e in self._spans)
        return min(1.0, busy / (now - lo))
