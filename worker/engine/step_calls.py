"""A scheduler's Step calls to its allocator, each sent until it is answered.

A step not answered (`AllocatorUnavailable`: down, restarting, its Redis
away) is sent again, the SAME operations under the same step id (applied
exactly once), after pauses doubling from the first to the second value of
`stall_backoff_s`; `on_stall(seconds)` is told each pause and `health` each
outcome. Any other error is a refusal: `AllocatorFault` (nothing applied).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from allocator_service.client import (
    AllocatorClient,
    AllocatorUnavailable,
    EmbeddedAllocator,
    PoolLost,
)
from allocator_service.core import Op, OpResult, StepAnswer
from allocator_service.core.tiers import TierReport
from worker.engine.health import AllocatorFault, AllocatorHealth
from worker.engine.step_plan import StepBatch

Answer = StepAnswer | list[OpResult]


class StepCalls:
    """The calls of one scheduler (engine thread), and a call sent ahead
    (`send_ahead`); `wait_total`: the seconds the engine thread spent in
    them, all steps."""

    def __init__(self, allocator: AllocatorClient, ahead: bool = False) -> None:
        self.allocator = allocator
        self.health = AllocatorHealth()
        self.stall_backoff_s: tuple[float, float] = (0.05, 1.0)
        self.on_stall: Callable[[float], None] | None = None
        self.wait_total = 0.0
        # A remote call waits on the network and the server: sent ahead, it
        # runs on one thread of its own while the forward pass runs. The
        # embedded core is pure Python that holds the GIL throughout, so a
        # thread would only interleave it with the forward pass: it runs
        # inline, still planned and applied a step ahead (the same rules,
        # whichever client).
        self._closing = threading.Event()  # set by `close`: an unanswered step stops waiting
        self._executor: ThreadPoolExecutor | None = None
        if ahead and not isinstance(allocator, EmbeddedAllocator):
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="allocator-call")

    def send(self, ops: list[Op], report: TierReport | None = None) -> Answer:
        """Send the step until it is answered, with the tiers' `report`."""
        pause = self.stall_backoff_s[0]
        health = self.health
        while True:
            health.call_started()
            try:
                results = (
                    self.allocator.step(ops) if report is None else self.allocator.step(ops, report)
                )
            except AllocatorUnavailable:
                health.unanswered()
                if self._closing.wait(pause):  # shutting down: the answer would be dropped
                    raise
                if self.on_stall is not None:
                    self.on_stall(pause)
                pause = min(pause * 2, self.stall_backoff_s[1])
                continue
            health.answered()
            return results

    def send_ahead(self, ops: list[Op], report: TierReport | None, batch: StepBatch) -> Future:
        """`send` for the step after the one about to be computed: on the call
        thread, or inline (its answer or error kept for `answer`)."""
        t0 = time.perf_counter()
        if self._executor is None:
            future: Future = Future()
            try:
                future.set_result(self.send(ops, report))
            except BaseException as exc:  # noqa: BLE001 - raised where the answer is collected
                future.set_exception(exc)
        else:
            future = self._executor.submit(self.send, ops, report)
        self._waited(batch, time.perf_counter() - t0)
        return future

    def answer(self, answer: Callable[[], Answer], batch: StepBatch) -> Answer:
        """`answer()`, the time waited for it counted on `batch`. PoolLost
        passes through (the client registered a fresh pool: an answer); any
        other error is a refusal, raised as AllocatorFault."""
        t0 = time.perf_counter()
        try:
            return answer()
        except PoolLost:
            self.health.answered()
            raise
        except Exception as exc:
            self.health.refused(exc)
            raise AllocatorFault(
                "allocator_refused", "the allocator refused this worker's step"
            ) from exc
        finally:
            self._waited(batch, time.perf_counter() - t0)

    def _waited(self, batch: StepBatch, seconds: float) -> None:
        batch.allocator_seconds += seconds
        self.wait_total += seconds

    def close(self) -> None:
        """Stop the call thread: a step the allocator does not answer is given up
        after the client's own retries (a worker shutting down with its allocator
        gone must not wait for it to come back)."""
        self._closing.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
