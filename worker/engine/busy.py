"""How busy the device was: `pagedkv_worker_device_busy_ratio`.

`BusyMeter.record(start, end)` takes one stretch of device work on the
engine's clock: a simulated step's interval on its stream (recorded when it
is launched, so it may end after now: a step queued behind another), a CUDA
step's time between its two events (ending when its outputs were read), the
CPU's forward pass. `ratio()` is the share of the last `window_s` seconds
(of the engine's clock) the device computed; `computed()` is the device time
up to now, so a caller can take the ratio over a span of its own.
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
        self._total = 0.0  # every stretch recorded, whole
        self.started = clock()

    def record(self, start: float, end: float) -> None:
        if end <= start:
            return
        with self._lock:
            self._spans.append((start, end))
            self._total += end - start
            horizon = end - self.window_s
            while self._spans and self._spans[0][1] < horizon:
                self._spans.popleft()

    def computed(self) -> float:
        """Seconds the device computed up to now, of every stretch recorded
        (of one that ends later, the part before now)."""
        now = self._clock()
        with self._lock:
            later = 0.0
            for s, e in reversed(self._spans):  # (in launch order: the last ones end last)
                if e <= now:
                    break
                later += e - max(s, now)
            return self._total - later

    def ratio(self) -> float:
        """Device time / clock time over the last window (since the start, if shorter)."""
        now = self._clock()
        lo = max(now - self.window_s, self.started)
        if now <= lo:
            return 0.0
        with self._lock:
            busy = sum(max(0.0, min(e, now) - max(s, lo)) for s, e in self._spans)
        return min(1.0, busy / (now - lo))
