"""Streaming API over LLMEngine for the HTTP server.

- The engine loop runs in one background thread (torch releases the GIL in
  its kernels); requests and aborts cross into it through a queue, outputs
  come back to each request's asyncio.Queue by `loop.call_soon_threadsafe`.
  A client that goes away (its generator closed) has its request aborted;
  its blocks are freed at the next step.
- The allocator away: the engine thread sends the same step until answered,
  while a watchdog fails every request in flight with `AllocatorFault` once
  the allocator has not answered for `allocator_give_up_after_s`, and new
  ones the same way until it answers. While idle the engine thread probes a
  remote allocator, so `problem()` (GET /health) is true without traffic.
- The engine thread dead (an error outside a step): every request in flight
  and every new one fails with `EngineDeadError`; `dead()` says so.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import abc
from collections.abc import AsyncIterator

from worker.engine.health import AllocatorFault, EngineDeadError
from worker.engine.llm_engine import LLMEngine, RequestError
from worker.engine.output_processor import RequestOutput
from worker.engine.sampling import SamplingParams

log = logging.getLogger("pagedkv.worker")


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.unhealthy_after_s = engine.config.allocator_unhealthy_after_s
        self.give_up_after_s = engine.config.allocator_give_up_after_s
        # While idle, ask a remote allocator whether it answers this often.
        self.probe_every_s = min(max(self.unhealthy_after_s / 3, 0.2), 5.0)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._died: EngineDeadError | None = None
        self._thread = threading.Thread(target=self._main, name="pagedkv-engine", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="pagedkv-give-up", daemon=True)
        self._watchdog.start()
        self.last_error: str | None = None

    # ------------------------------------------------------------- public
    async def generate(
        self,
        prompt: str | abc.Sequence[int],
        params: SamplingParams,
        request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """Yield an output per new token of each sample (`index`); the last
        one has `request_finished=True`.
        Raises RequestError (before the first yield) for a request that can
        never be served."""
        gave_up = self.gave_up()
        if gave_up is not None:
            raise gave_up
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (loop, q)
        if self._died is not None:  # after registering: a death from now on fails this stream too
            with self._lock:
                self._streams.pop(request_id, None)
            raise EngineDeadError(str(self._died))
        # A refusal (RequestError) comes through the queue like an output, as
        # does AllocatorFault if the watchdog gives up first.
        self._inbox.put(("add", request_id, prompt, params))
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.request_finished:
                    return
        finally:
            with self._lock:
                live = self._streams.pop(request_id, None) is not None
            if live:  # the consumer left early: free the sequence
                self._inbox.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def dead(self) -> EngineDeadError | None:
        """Why the engine thread is gone (an error it could not survive), or None."""
        return self._died

    def problem(self) -> AllocatorFault | None:
        """Why this worker cannot serve now (GET /health says 503), or None:
        the allocator refused its last call (the pool is lost to this worker)
        or has not answered for `unhealthy_after_s`."""
        health = self.engine.health
        refusal = health.refusal
        if refusal is not None:
            error = AllocatorFault(
                "allocator_refused", "the KV-cache allocator refused this worker's pool"
            )
            error.__cause__ = refusal
            return error
        return self._unreachable(self.unhealthy_after_s)

    def gave_up(self) -> AllocatorFault | None:
        """The error for requests while the allocator has not answered for
        `give_up_after_s`, else None."""
        return self._unreachable(self.give_up_after_s)

    def _unreachable(self, after_s: float) -> AllocatorFault | None:
        seconds = self.engine.health.unreachable_for()
        if seconds < after_s:
            return None
        return AllocatorFault(
            "allocator_unreachable",
            f"the KV-cache allocator has not answered for {seconds:.0f} s",
            seconds,
        )

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)
        self.engine.close()

    # ------------------------------------------------------------- watchdog
    def _watch(self) -> None:
        """Fail every request in flight once the allocator is past the give-up
        time. The engine thread, stuck sending its step, aborts them when the
        step is answered (so what the allocator accepted is still computed)."""
        while not self._stop.wait(0.25):
            error = self.gave_up()
            if error is None:
                continue
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, error)
                self._inbox.put(("abort", rid))
            if rids:
                log.warning(
                    "allocator unreachable for %.0f s: failed %d request(s)",
                    error.seconds,
                    len(rids),
                )

    # ------------------------------------------------------------- engine thread
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
            if target is not None and (isinstance(item, BaseException) or item.request_finished):
                del self._streams[request_id]
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, params = msg
            with self._lock:
                live = rid in self._streams
            if not live:
                return  # failed (given up) or left before the engine took it in
            try:
                self.engine.add_request(prompt, params, rid)
            except RequestError as exc:
                self._deliver(rid, exc)
            except ValueError as exc:
                self._deliver(rid, RequestError(str(exc)))
            except Exception as exc:  # noqa: BLE001 - fail this request, keep the engine thread alive
                log.exception("could not add request %s", rid)
                self._deliver(rid, RuntimeError(f"could not add the request: {exc}"))
        elif kind == "abort":
            self.engine.abort(msg[1])

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.critical(
                "the engine thread died; this worker serves nothing until it restarts",
                exc_info=True,
            )
            self._died = EngineDeadError(
                f"the engine thread died ({type(exc).__name__}: {exc})"[:300]
            )
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, self._died)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            block = not engine.has_unfinished()
            try:
                msg = self._inbox.get(
                    block=block, timeout=min(0.5, self.probe_every_s) if block else None
                )
                self._handle(msg)
                while True:  # drain everything that arrived meanwhile
                    self._handle(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if not engine.has_unfinished():
                if (
                    engine.remote_allocator
                    and time.monotonic() - engine.health.last_answer >= self.probe_every_s
                ):
                    engine.probe_allocator()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed")
                self.last_error = repr(exc)
                error = (
                    exc
                    if isinstance(exc, AllocatorFault)
                    else RuntimeError(f"engine step failed: {exc}")
                )
                with self._lock:
                    rids = list(self._streams)
                for rid in rids:
                    engine.abort(rid)
                    self._deliver(rid, error)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
