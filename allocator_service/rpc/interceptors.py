"""Server interceptors: the bearer tokens and the caller's role
(`roles.py` holds the table, and what a worker token may register), and
per-RPC latency by method and status code.

Both wrap the handler's behaviour rather than answering from the interceptor
itself, because a rejection must still be an RPC of the right shape (unary
or streaming) and still be counted by the metrics interceptor outside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from allocator_service.roles import Roles, reset_caller_role, set_caller_role
from allocator_service.rpc import status
from allocator_service.wire.errors import NotLeader, ServiceError

# Health probes (kubelet, load balancers) carry no token.
AUTH_EXEMPT = ("/grpc.health.v1.Health/",)
# What a standby answers itself: health (its role shows there) and reflection.
UNFENCED = (*AUTH_EXEMPT, "/grpc.reflection.")

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


def _refusal(exc: Exception):
    def refuse(behaviour, streams_out):
        def unary(request, context):
            status.abort(context, exc)

        def stream(request, context):
            status.abort(context, exc)
            yield  # pragma: no cover - makes this a generator

        return stream if streams_out else unary

    return refuse


class RoleInterceptor(grpc.ServerInterceptor):
    """Finds the caller's role from its bearer token and refuses a method the
    role may not call (`Roles.check`: UNAUTHENTICATED or PERMISSION_DENIED);
    the handler then runs with the role set (`roles.caller_role()`)."""

    def __init__(self, roles: Roles) -> None:
        self._roles = roles

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or full.startswith(AUTH_EXEMPT):
            return handler
        bearer = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                bearer = value.encode() if isinstance(value, str) else value
                break
        method = full.rsplit("/", 1)[-1]
        try:
            role = self._roles.check(method, bearer)
        except ServiceError as exc:
            return _rewrap(handler, _refusal(exc))
        grant = self._roles.grant_of(bearer) if method == "RegisterPool" else None

        def as_role(behaviour, streams_out):
            def call(request, context):
                if method == "RegisterPool":  # a worker token registers its own worker only
                    try:
                        self._roles.check_registration(
                            role, grant, request.worker_id, request.advertise_url
                        )
                    except ServiceError as exc:
                        status.abort(context, exc)
                token = set_caller_role(role)
                try:
                    return behaviour(request, context)
                finally:
                    reset_caller_role(token)

            def stream(request, context):
                # A streaming handler's code runs as its responses are
                # drawn: the role is set around each draw, not just around
                # making the generator.
                responses = call(request, context)
                while True:
                    token = set_caller_role(role)
                    try:
                        response = next(responses)
                    except StopIteration:
                        return
                    finally:
                        reset_caller_role(token)
                    yield response

            return stream if streams_out else call

        return _rewrap(handler, as_role)


class StandbyInterceptor(grpc.ServerInterceptor):
    """A standby answers every call but the health check (and reflection)
    with UNAVAILABLE `not_leader` and the leader's address
    (`NotLeader`); on a step stream opened while this instance led,
    each request is looked at as it arrives, so a deposed leader serves no
    step on it either. `leader()`: (leading, the leader's address)."""

    def __init__(self, leader: Callable[[], tuple[bool, str]]) -> None:
        self._leader = leader

    def _refusal(self) -> NotLeader | None:
        leading, address = self._leader()
        return None if leading else NotLeader(address)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNFENCED):
            return handler
        refusal = self._refusal()
        if refusal is not None:
            return _rewrap(handler, _refusal(refusal))
        if not handler.request_streaming:
            return handler

        def per_request(behaviour, streams_out):
            def call(requests, context):
                def arriving():
                    for request in requests:
                        refused = self._refusal()
                        if refused is not None:
                            # ends the stream with its status, as the handler's own errors do
                            raise refused
                        yield request

                return behaviour(arriving(), context)

            return call

        return _rewrap(handler, per_request)


class MetricsInterceptor(grpc.ServerInterceptor):
    """Observes every unary call's latency into a histogram labelled by
    method and status code, and on a bidirectional stream (StepStream) each
    request's, from its arrival to its answer (or to the error that ends
    the stream). (Server streams such as WatchEvents live for minutes;
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
            if streams_out and handler.request_streaming:
                return self._per_message(method, behaviour)
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

    def _per_message(self, method: str, behaviour: Callable) -> Callable:
        """A request-response stream timed per request: from the moment the
        handler draws a request to the moment its answer is yielded."""

        def call(requests, context):
            started: list[float] = []  # the request in flight: its arrival

            def arriving():
                for request in requests:
                    started[:] = (time.perf_counter(),)
                    yield request

            try:
                for response in behaviour(arriving(), context):
                    if started:
                        self._observe(method, "OK", time.perf_counter() - started.pop())
                    yield response
            except Exception:
                if started:
                    status = context.code()
                    self._observe(
                        method,
                        status.name if status is not None else "UNKNOWN",
                        time.perf_counter() - started.pop(),
                    )
                raise

        return call
