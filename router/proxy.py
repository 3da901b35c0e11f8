"""One request forwarded to the ranked workers, its answer passed on.

The body goes unchanged to the first worker; the answer (JSON or server-sent
events) is passed on chunk by chunk, with `x-pagedkv-worker`,
`x-pagedkv-cached-tokens` (what its pool and tiers held of the prompt when it
was routed) and `x-pagedkv-routing-ms`; hop-by-hop headers and the client's
credentials are not forwarded. Up to `max_attempts` workers:
- refused, no status within `first_byte_timeout`, or 502/503/504 before any
  byte reached the client: skipped (cooling down `cooldown_s`), the next asked;
- the head sent but no status in time: 504 `worker_timeout`, not retried;
- an answer not a stream, up to `WHOLE_ANSWER_BYTES`, is read whole (a failure
  during it is skipped the same way); a longer one is passed on as it comes;
- past `max_answer_bytes`: 502 `worker_answer_too_large` when the worker says
  its size, else cut; `first_byte_timeout` also bounds the rest of a body and
  each gap between events: 504 `worker_timeout` while nothing was passed on;
- past the first byte, a failure ends a stream with an `{"error": ...}` event
  and `[DONE]`, and cuts a body;
- no worker left: 503 `no_worker_available`.
The reasons: docs/architecture.md, "The router's rules, and why".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from pagedkv_base.api.disconnect import ClientGone, unless_gone
from pagedkv_base.api.errors import ApiError
from pagedkv_base.api.tenants import TENANT_HEADER
from router.discovery import Worker
from router.metrics import RouterMetrics
from router.placement import Placement

log = logging.getLogger(__name__)

# A worker's answer with one of these statuses is retried elsewhere (nothing was sent yet).
RETRY_STATUSES = frozenset((502, 503, 504))
# A whole (non-stream) answer up to this size is read before it is passed on (a worker failing
# during it is skipped); a longer one is passed on as it arrives, so the router holds a chunk of it.
WHOLE_ANSWER_BYTES = 1 << 20
# Not forwarded either way (hop-by-hop, set anew by this hop, or the client's credentials).
_HOP = frozenset(
    (
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"upgrade",
        b"proxy-authorization",
        b"proxy-connection",
        b"authorization",
        b"cookie",
        TENANT_HEADER.encode(),
    )
)
_HOP_OUT = frozenset(
    ("connection", "keep-alive", "transfer-encoding", "date", "server", "content-length")
)


class Proxy:
    """The connection pool to the workers and the failure rules; the load and
    the placements it changes are `placement`'s."""

    def __init__(
        self,
        placement: Placement,
        metrics: RouterMetrics,
        *,
        first_byte_timeout: float,
        connect_timeout: float,
        max_attempts: int,
        max_answer_bytes: int,
    ) -> None:
        self.placement = placement
        self.metrics = metrics
        self.first_byte_timeout = first_byte_timeout
        self.connect_timeout = connect_timeout
        self.max_attempts = max_attempts
        self.max_answer_bytes = max_answer_bytes
        self._http: aiohttp.ClientSession | None = None  # made in the server's event loop (`http`)

    @property
    def http(self) -> aiohttp.ClientSession:
        """The connection pool to the workers (aiohttp: a third of httpx's
        time per proxied request here). Bodies pass unchanged both ways: no
        decompression, no headers of its own beyond Host and Content-Length."""
        if self._http is None:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
                trace_configs=[_HEADERS_SENT],
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._http

    async def forward(
        self,
        request: Request,
        order: Sequence[tuple[Worker, int]],
        rid: int,
        tokens: list[int] | None,
        salt: str | None,
        auth: list[tuple[str, str]],
        stream: bool,
        routing_s: float,
        *,
        body: bytes | None = None,
        answer_headers: dict[str, str] | None = None,
        prefill_leg: bool = False,
    ) -> Response:
        """`request`'s body (or `body`) to the workers of `order` ((worker, its cached
        tokens), best first, the first placed as request `rid`), with `auth` for the
        client's credentials; `answer_headers` added to the answer's. A `prefill_leg`
        counts as one, not as a client request (the decode leg is the client's)."""
        placement = self.placement
        policy = placement.policy
        best = max((c for _, c in order), default=0)
        if body is None:
            body = await request.body()
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers.raw
            if k.lower() not in _HOP
        ] + auth
        why = "no worker answered"
        for worker, cached in order[: self.max_attempts]:
            if tokens and worker is not order[0][0]:  # a retry: placed on the next in the ranking
                placement.placed(rid, worker, tokens, salt)
            try:
                upstream, start, whole = await unless_gone(
                    request, self._send(worker, request.url.path, body, headers, stream)
                )
            except ClientGone:  # the worker's connection is closed: it aborts the request
                placement.failed(rid)
                return Response(status_code=499)  # nobody reads it
            except _Started as started:
                # the worker has the request: another would compute it again
                placement.failed(rid)
                self.metrics.failed.labels("worker_timeout").inc()
                log.warning("worker %s at %s: %s; not retried", worker.name, worker.url, started)
                raise ApiError(
                    504,
                    f"{worker.name} took the request but sent no answer within "
                    f"{self.first_byte_timeout:g} s; it is not sent to another worker, which "
                    "would compute it again",
                    type_="server_error",
                    code="worker_timeout",
                ) from None
            except _TooLarge as large:  # computed: another worker would compute as much again
                placement.failed(rid)
                self.metrics.failed.labels("worker_answer_too_large").inc()
                log.warning("worker %s at %s: %s; not retried", worker.name, worker.url, large)
                raise ApiError(
                    502,
                    f"{worker.name}'s answer is larger than the router passes on "
                    f"({self.max_answer_bytes} bytes: PAGEDKV_ROUTER_MAX_ANSWER_MB): {large}",
                    type_="server_error",
                    code="worker_answer_too_large",
                ) from None
            except _Skip as skip:
                placement.failed(rid)
                why = f"{worker.name}: {skip}"
                self.metrics.retries.labels(skip.reason).inc()
                log.warning("worker %s at %s: %s; trying another", worker.name, worker.url, skip)
                continue
            except BaseException:  # cancelled (the client left): nothing is computed for it
                placement.failed(rid)
                raise
            if prefill_leg:
                self.metrics.pd_prefill_legs.labels(worker.name).inc()
            else:
                self.metrics.routed.labels(worker.name, policy).inc()
                self.metrics.prompt_tokens.labels(policy).inc(len(tokens or ()))
                self.metrics.cached_chosen.labels(policy).inc(cached)
                self.metrics.cached_best.labels(policy).inc(best)
            headers_out = self._answer_headers(worker, upstream, cached, routing_s)
            headers_out.update(answer_headers or {})
            if whole:  # the whole answer is here: one response, the worker's connection free
                placement.answered(rid)
                return Response(start, status_code=upstream.status, headers=headers_out)
            return self._relay(worker, upstream, headers_out, rid, start)
        self.metrics.failed.labels("no_worker_available").inc()
        raise ApiError(
            503,
            f"no worker could take the request ({why})",
            type_="server_error",
            code="no_worker_available",
        )

    async def _send(
        self, worker: Worker, path: str, body: bytes, headers, stream: bool
    ) -> tuple[aiohttp.ClientResponse, bytes, bool]:
        """The worker's answer, status and headers read, with the start of its body and
        whether that is all of it: a request that did not ask for a stream has its body
        read whole when it is at most WHOLE_ANSWER_BYTES (the connection goes back to
        the pool; a worker failing during it is skipped), else its first bytes (the rest
        is passed on). _Skip when it is not to be used (nothing has reached the client);
        _Started when the worker took the request and did not answer in time;
        _TooLarge for an answer that says it is over `max_answer_bytes`."""
        placement = self.placement
        placement.enter(worker)
        upstream = None
        # `_headers_sent` marks it once the request's head is on the wire
        sent: dict[str, bool] = {}
        try:
            upstream = await asyncio.wait_for(
                self.http.post(
                    worker.url + path, data=body, headers=headers, trace_request_ctx=sent
                ),
                self.first_byte_timeout,
            )
            if upstream.status in RETRY_STATUSES:
                skip = _Skip("unavailable", f"it answered {upstream.status}")
            elif (upstream.content_length or 0) > self.max_answer_bytes:
                skip = _TooLarge(f"it answered {upstream.content_length} bytes")
            elif stream and upstream.content_type == "text/event-stream":
                return upstream, b"", False  # still in flight: the relay ends it
            else:
                start = await asyncio.wait_for(
                    _read_upto(upstream, WHOLE_ANSWER_BYTES + 1), self.first_byte_timeout
                )
                if len(start) <= WHOLE_ANSWER_BYTES:
                    placement.leave(worker)  # read whole: the connection goes back to the pool
                    return upstream, start, True
                return upstream, start, False
        except aiohttp.ClientError as exc:  # before TimeoutError: a connect timeout is one of these
            skip = _Skip("unreachable", type(exc).__name__)
        except TimeoutError:
            if sent:
                skip = _Started(f"no answer within {self.first_byte_timeout:g} s")
            else:
                skip = _Skip("timeout", f"no connection within {self.first_byte_timeout:g} s")
        except BaseException:
            if upstream is not None:
                upstream.close()
            placement.leave(worker)
            raise
        if upstream is not None:
            upstream.close()
        placement.leave(worker, down=True)
        raise skip

    @staticmethod
    def _answer_headers(
        worker: Worker, upstream: aiohttp.ClientResponse, cached: int, routing_s: float
    ) -> dict[str, str]:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_OUT}
        headers["x-pagedkv-worker"] = worker.name
        headers["x-pagedkv-cached-tokens"] = str(cached)  # its pool and tiers, when routed
        headers["x-pagedkv-routing-ms"] = f"{routing_s * 1000:.3f}"  # choosing it took
        return headers

    def _relay(
        self,
        worker: Worker,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        rid: int,
        start: bytes = b"",
    ) -> Response:
        """The rest of an answer passed on chunk by chunk as it arrives, after `start`:
        a stream of events, or a body too long to hold whole. Bounded: at most
        `max_answer_bytes` in all, and the worker may keep the router waiting at most
        `first_byte_timeout` in all for a body, or between two events of a stream (a
        worker sending a byte at a time is waited for as long as one sending nothing).
        Past either bound the answer ends: a stream with an error event, a body with
        the connection closed before its end (the client sees it cut)."""
        done = False
        events = upstream.content_type == "text/event-stream"

        def close() -> None:
            nonlocal done
            if not done:
                done = True
                self.placement.answered(rid)
                upstream.close()
                self.placement.leave(worker)

        def failed(reason: str, message: str, code: str | None = None) -> bytes:
            self.metrics.failed.labels(reason).inc()
            log.warning("worker %s: %s", worker.name, message)
            if not events:
                raise _Cut(message)  # the body ends unfinished: uvicorn closes the connection
            error = {
                "error": {
                    "message": message,
                    "type": "server_error",
                    "param": None,
                    "code": code or reason,
                }
            }
            # (a blank line first ends any event the worker left unfinished)
            return f"\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()

        async def chunks() -> AsyncIterator[bytes]:
            # the worker's time so far: for a body, or since the last event
            total, waited = (len(start), 0.0)
            try:
                if start:
                    yield start
                while True:
                    t0 = time.monotonic()
                    try:
                        chunk = await asyncio.wait_for(
                            upstream.content.readany(), max(self.first_byte_timeout - waited, 0.0)
                        )
                    except TimeoutError:
                        yield failed(
                            "worker_timeout",
                            f"the worker sent no {'event' if events else 'answer'} "
                            f"within {self.first_byte_timeout:g} s",
                        )
                        return
                    if not chunk:
                        return
                    waited = 0.0 if events and b"\n\n" in chunk else waited + time.monotonic() - t0
                    total += len(chunk)
                    if total > self.max_answer_bytes:
                        yield failed(
                            "worker_answer_too_large",
                            f"the worker's answer passed {self.max_answer_bytes} bytes",
                        )
                        return
                    yield chunk
            except aiohttp.ClientError as exc:
                yield failed(
                    "worker_failed_mid_answer",
                    f"the worker failed mid-answer ({type(exc).__name__})",
                    "worker_failed",
                )
            finally:
                close()

        return StreamingResponse(
            chunks(), status_code=upstream.status, headers=headers, background=BackgroundTask(close)
        )

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()


async def _headers_sent(_session, context, _params) -> None:
    if isinstance(context.trace_request_ctx, dict):
        context.trace_request_ctx["sent"] = True


_HEADERS_SENT = aiohttp.TraceConfig()
_HEADERS_SENT.on_request_headers_sent.append(_headers_sent)


class _Started(Exception):
    """The worker took the request (its head was sent) but did not answer in time."""


class _TooLarge(Exception):
    """The worker's answer says it is over the router's bound: not passed on, not retried."""


class _Cut(Exception):
    """A body passed on ends unfinished (the worker broke a bound mid-answer)."""


async def _read_upto(upstream: aiohttp.ClientResponse, n: int) -> bytes:
    """The body's first `n` bytes, or all of it when shorter."""
    parts: list[bytes] = []
    size = 0
    while size < n:
        chunk = await upstream.content.read(n - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


class _Skip(Exception):
    """This worker is not to be used for this request; `reason` is the
    metrics label (`unreachable`, `timeout`, `unavailable`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
