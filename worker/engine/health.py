"""Is the allocator answering this worker? The facts /health and the give-up
read (and `EngineDeadError`: the engine thread itself is gone).

Only the engine thread calls the allocator for the engine (steps, and a probe
while idle) and tells `AllocatorHealth` when a call starts, is answered, goes
unanswered (`AllocatorUnavailable`) or is refused (any other error: the pool
is lost to this worker); other threads only read. "Unreachable for" counts
from the start of the first unanswered call (its client's retries included);
any answer resets it.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class AllocatorFault(RuntimeError):
    """A request failed because of the allocator, not because of itself.

    `reason` is `"allocator_unreachable"` (no answer for `seconds`, past the
    give-up time) or `"allocator_refused"` (the allocator answered a step with
    an error; the original exception is the `__cause__`). Its text is written
    by the worker, never by gRPC: worker/server/errors.py turns it into the
    HTTP answer.
    """

    def __init__(self, reason: str, message: str, seconds: float = 0.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.seconds = seconds


class EngineDeadError(RuntimeError):
    """The engine thread has died: no request can be served until the worker
    restarts. /health answers 503 with code `engine_dead`, requests a 503."""

    reason = "engine_dead"


class AllocatorHealth:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._call_since: float | None = None  # the call in flight started
        self._failing_since: float | None = None  # the first unanswered call started
        self.refusal: BaseException | None = None  # the allocator's last refusal, until an answer
        self.last_answer = clock()

    # ------------------------------------------------------- the engine thread
    def call_started(self) -> None:
        self._call_since = self._clock()

    def answered(self) -> None:
        self._call_since = self._failing_since = None
        self.refusal = None
        self.last_answer = self._clock()

    def unanswered(self) -> None:
        if self._failing_since is None:
            self._failing_since = (
                self._call_since if self._call_since is not None else self._clock()
            )
        self._call_since = None

    def refused(self, exc: BaseException) -> None:
        self._call_since = self._failing_since = None
        self.refusal = exc
        self.last_answer = self._clock()

    # ----------------------------------------------------------- any thread
    def unreachable_for(self) -> float:
        """Seconds since the allocator last failed to answer a
        call still unanswered (0: answering)."""
        since = self._failing_since if self._failing_since is not None else self._call_since
        return 0.0 if since is None else max(0.0, self._clock() - since)
