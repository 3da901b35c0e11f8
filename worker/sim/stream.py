"""The simulated device's clocks and its stream.

A `DeviceStream` runs like one CUDA stream: `launch(seconds)` returns at
once with the time the work will be done (after everything launched before
it), and `wait(done)` blocks until then. The host keeps working meanwhile,
as it does while a GPU computes.

`WallClock`: the device time really passes (the engine sleeps until the
outputs are ready), so the host's own work is measured against it.
`VirtualClock`: the clock advances only by device time (waiting jumps to the
done time); host time is not counted, so a study runs as fast as the host.

`StreamEvent`: a point on the stream, as a CUDA event recorded after some work:
`query()` says whether the clock has passed it, `synchronize()` waits for it.
"""

from __future__ import annotations

import threading
import time

__all__ = ["CLOCKS", "DeviceStream", "StreamEvent", "VirtualClock", "WallClock", "make_clock"]

CLOCKS = ("wall", "virtual")


class WallClock:
    virtual = False

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def wait_until(self, t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class VirtualClock:
    """Seconds of device time since the engine started; only waiting moves it."""

    virtual = True

    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._now

    def wait_until(self, t: float) -> None:
        with self._lock:
            if t > self._now:
                self._now = t


def make_clock(name: str) -> WallClock | VirtualClock:
    if name == "wall":
        return WallClock()
    if name == "virtual":
        return VirtualClock()
    raise ValueError(f"--clock must be one of {', '.join(CLOCKS)}, got {name!r}")


class StreamEvent:
    """Done once the clock reaches `at` (the interface of a CUDA event that `Transfer` uses)."""

    __slots__ = ("at", "clock")

    def __init__(self, clock: WallClock | VirtualClock, at: float) -> None:
        self.clock, self.at = clock, at

    def query(self) -> bool:
        return self.clock.now() >= self.at

    def synchronize(self) -> None:
        self.clock.wait_until(self.at)


class DeviceStream:
    """Work queued on one simulated device, in launch order."""

    def __init__(self, clock: WallClock | VirtualClock) -> None:
        self.clock = clock
        self._free_at = clock.now()

    def launch(self, seconds: float) -> tuple[float, float]:
        """Queue `seconds` of device work; its (start, done) times on the clock."""
        start = max(self.clock.now(), self._free_at)
        self._free_at = start + seconds
        return start, self._free_at

    def wait(self, done: float) -> None:
        """Block (on the wall clock) or jump (on the virtual one) until `done`."""
        self.clock.wait_until(done)
