"""Streaming API over LLMEngine for the HTTP server.

The engine loop runs in one background thread (torch releases the GIL in its
kernels, so the event loop stays responsive); requests and aborts cross into
it through a queue, outputs come back to each request's asyncio.Queue through
`loop.call_soon_threadsafe`. A client that goes away (its async generator is
closed) has its request aborted, and the sequence's blocks are freed at the
next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq

from worker.engine.llm_engine import LLMEngine, RequestError
from worker.engine.output_processor import RequestOutput
from worker.engine.sampling import SamplingParams

log = logging.getLogger("pagedkv.worker")


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pagedkv-engine", daemon=True)
        self._thread.start()
        self.last_error: str | None = None

    # ------------------------------------------------------------- public
    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """Yield an output per new token; the last one has `finished=True`.
        Raises RequestError (before the first yield) for a request that can
        never be served."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        added: asyncio.Future = loop.create_future()
        with self._lock:
            self._streams[request_id] = (loop, q)
        self._inbox.put(("add", request_id, prompt, params, added))
        try:
            await added  # raises RequestError if the engine refused it
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            with self._lock:
                live = self._streams.pop(request_id, None) is not None
            if live:  # the consumer left early: free the sequence
                self._inbox.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)
        self.engine.close()

    # ------------------------------------------------------------- engine thread
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
            if target is not None and (isinstance(item, BaseException) or item.finished):
                del self._streams[request_id]
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, params, fut = msg
            try:
                self.engine.add_request(prompt, params, rid)
            except (RequestError, ValueError) as exc:
                fut.get_loop().call_soon_threadsafe(_set_exception, fut, RequestError(str(exc)))
                return
            except Exception as exc:  # noqa: BLE001 - fail this request, keep the engine thread alive
                log.exception("could not add request %s", rid)
                fut.get_loop().call_soon_threadsafe(_set_exception, fut, RuntimeError(f"could not add the request: {exc}"))
                return
            fut.get_loop().call_soon_threadsafe(_set_result, fut)
        elif kind == "abort":
            self.engine.abort(msg[1])

    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                msg = self._inbox.get(block=block, timeout=0.5 if block else None)
                self._handle(msg)
                while True:  # drain everything that arrived meanwhile
                    self._handle(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed")
                self.last_error = repr(exc)
                with self._lock:
                    rids = list(self._streams)
                for rid in rids:
                    self.engine.abort(rid)
                    self._deliver(rid, RuntimeError(f"engine step failed: {exc}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
