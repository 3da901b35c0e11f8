"""Server interceptors: the server-wide bearer token, and per-RPC latency by
method and status code.

Both wrap the handler's behaviour rather than answering from the interceptor
itself, because a rejection must still be an RPC of the right shape (unary
or streaming) and still be counted by the metrics interceptor outside it.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable

import grpc

from allocator_service import errors
from allocator_service.errors import Unauthenticated

# Health probes (kubelet, load balancers) carry no token.
AUTH_EXEMPT = ("/grpc.health.v1.Health/",)

_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


def _rewrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable, bool], Callable]):
    """The same handler with its behaviour passed through `wrap(behaviour,
    streams_out)`."""
    for kind, make in _KINDS:
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return make(
                wrap(behaviour, handler.response_streaming),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


class BearerAuthInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) a call without `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("empty auth token")
        self._expected = f"Bearer {token}".encode()

    def _allowed(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                raw = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(raw, self._expected)
        return False

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(AUTH_EXEMPT):
            return handler
        if self._allowed(handler_call_details.invocation_metadata):
            return handler

        def refuse(behaviour, streams_out):
            exc = Unauthenticated("missing or wrong bearer token (authorization metadata)")

            def unary(request, context):
                errors.abort(context, exc)

            def stream(request, context):
                errors.abort(context, exc)
                yield  # pragma: no cover - makes this a generator

            return stream if streams_out else unary

        return _rewrap(handler, refuse)


class MetricsInterceptor(grpc.ServerInterceptor):
    """Observes every unary call's latency into a histogram labelled by
    method and status code. (Streams such as WatchEvents live for minutes;
    their duration is not a latency, so they are not observed.)"""

    def __init__(self, histogram) -> None:
        self._histogram = histogram
        self._children: dict[tuple[str, str], object] = {}  # labels() is slow-ish: cache

    def _observe(self, method: str, code: str, seconds: float) -> None:
        child = self._children.get((method, code))
        if child is None:
            child = self._children.setdefault((method, code), self._histogram.labels(method, code))
        child.observe(seconds)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]

        def timed(behaviour, streams_out):
            if streams_out:
                return behaviour

            def call(request, context):
                t0 = time.perf_counter()
                code = "OK"
                try:
                    return behaviour(request, context)
                except BaseException:
                    status = context.code()
                    code = status.name if status is not None else "UNKNOWN"
                    raise
                finally:
                    self._observe(method, code, time.perf_counter() - t0)

            return call

        return _rewrap(handler, timed)
