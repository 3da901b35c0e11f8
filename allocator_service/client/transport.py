"""What both gRPC clients share: channels, one allocator's addresses (a
leader and its standbys) and the one calls go to now (`Targets`), deadlines
and retries with backoff (`Caller`), which failures are sent again
(`transient`), and the open StepStream call (`StepStream`)."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from allocator_service.client.base import AllocatorUnavailable
from allocator_service.wire.errors import ERROR_KEY, LEADER_KEY, NOT_LEADER, POOL_CALLS
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import allocator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Refusals that mean "not now": retried the same way (the pool's slow calls in flight).
RETRYABLE_REASONS = (POOL_CALLS,)
# How gRPC ends a call that the allocator's code never answered (no
# `pagedkv-error` reason): the connection, a proxy or the server's shutdown
# cut it. Besides UNAVAILABLE, gRPC reports a transport torn down mid-call
# as UNKNOWN ("Stream removed", grpc/grpc#34076) or INTERNAL (a peer's
# RST_STREAM), and a call the stopping server cancelled as CANCELLED.
TRANSPORT = frozenset(
    (*RETRYABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
)

# Reconnect quickly after the server restarts (grpc's default backoff grows
# to two minutes, far longer than a restart takes).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)


# With several addresses, the longest pause between attempts (a failover
# takes about the leader's lease: a longer backoff would only add to it).
FAILOVER_BACKOFF_CAP_S = 0.25
# A standby naming as leader an address that gave no answer this recently is
# waited on rather than left: that leader is dead and the lease runs out.
SUSPECT_S = 1.5


def _trailer(err: grpc.RpcError, name: str) -> str:
    for key, value in (err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else ():
        if key == name:
            return value
    return ""


def error_reason(err: grpc.RpcError) -> str:
    """The server's machine-readable reason (`pagedkv-error` trailer)."""
    return _trailer(err, ERROR_KEY)


def split_addresses(target: str) -> list[str]:
    """`HOST:PORT[,HOST:PORT...]` (or `|` between them, as a router's
    `--allocator` writes one allocator among several): one allocator's
    addresses (its leader and standbys, in any order), each once;
    ValueError for an empty one."""
    addresses = [a.strip() for a in target.replace("|", ",").split(",")]
    if any(not a for a in addresses):
        raise ValueError(f"an empty allocator address in {target!r}")
    return list(dict.fromkeys(addresses))


def transient(err: grpc.RpcError) -> bool:
    """Whether a failed call is to be sent again: the allocator said "not
    now" (UNAVAILABLE, or a reason in RETRYABLE_REASONS), or gave no answer
    at all (a TRANSPORT status without its reason). Every answer of the
    allocator's own code names a reason, so a refusal is never retried."""
    reason = error_reason(err)
    if reason:
        return err.code() in RETRYABLE or reason in RETRYABLE_REASONS
    return err.code() in TRANSPORT


def open_channel(target: str, tls_ca: str | bytes | None = None, options=(), *, aio: bool = False):
    """A channel to `target`; TLS when a CA certificate (path or PEM) is given.
    `aio`: a `grpc.aio` channel, bound to the running event loop."""
    opts = list(CHANNEL_OPTIONS) + list(options)
    kind = grpc.aio if aio else grpc
    if tls_ca is None:
        return kind.insecure_channel(target, options=opts)
    if isinstance(tls_ca, str):
        with open(tls_ca, "rb") as f:
            tls_ca = f.read()
    return kind.secure_channel(
        target, grpc.ssl_channel_credentials(root_certificates=tls_ca), options=opts
    )


class Targets:
    """The addresses of one allocator (a leader and its standbys): a channel
    to each, opened on first use and kept, and the one calls go to now."""

    def __init__(self, target: str, tls_ca: str | bytes | None) -> None:
        self.addresses = split_addresses(target)
        self._tls_ca = tls_ca
        self._channels: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.current = self.addresses[0]
        self.switches = 0
        self._unanswered: dict[str, float] = {}  # address -> when a call to it last got no answer

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    def channel(self, address: str | None = None):
        address = address or self.current
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(address, self._tls_ca)
            return channel

    def use(self, address: str, why: str) -> None:
        with self._lock:
            if address == self.current:
                return
            log.warning("allocator: calls go to %s now (%s)", address, why)
            self.current = address
            self.switches += 1

    def after_failure(self, address: str, err: grpc.RpcError) -> bool:
        """A call to `address` failed with the transient `err`: follow the
        leader. True when the next attempt should go at once (sent to the
        leader a standby named, or already moved on by another thread)."""
        if not self.several:
            return False
        if self.current != address:
            return True  # moved on meanwhile (the watchdog found the leader)
        if error_reason(err) == NOT_LEADER:
            leader = _trailer(err, LEADER_KEY)
            if leader in self.addresses and leader != address:
                if time.monotonic() - self._unanswered.get(leader, -SUSPECT_S) < SUSPECT_S:
                    # it names a leader that just did not answer: its lease runs out; stay
                    return False
                self.use(leader, f"{address} is a standby")
                return True
            if leader == address:
                return False  # it says it leads again: ask it again after the backoff
            # no leader yet (the lease runs out), or one named otherwise: the next address
        elif not error_reason(err):
            self._unanswered[address] = time.monotonic()
        i = self.addresses.index(address)
        self.use(self.addresses[(i + 1) % len(self.addresses)], f"{address}: {err.code().name}")
        return False

    def serving_elsewhere(self, timeout_s: float) -> str | None:
        """Another address whose health says it serves the Allocator service
        (the leader), or None."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        name = pb.DESCRIPTOR.services_by_name["Allocator"].full_name
        for address in self.addresses:
            if address == self.current:
                continue
            try:
                reply = health_pb2_grpc.HealthStub(self.channel(address)).Check(
                    health_pb2.HealthCheckRequest(service=name), timeout=timeout_s
                )
            except grpc.RpcError:
                continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return address
        return None

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


class _StreamBroken(grpc.RpcError):
    """A step stream that ended without an answer: the same retry as a
    failed unary call. `code()` says which retry: DEADLINE_EXCEEDED when the
    watchdog cut it, UNAVAILABLE when it ended otherwise."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ()


_END = object()  # ends a step stream's request iterator


class StepStream:
    """One open StepStream call: a request put on the queue, its answer read
    from the call, in order."""

    def __init__(self, stub, metadata) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        # No timeout on the call: it lives as long as the client; each
        # step's deadline is the watchdog's (`GrpcAllocator._watch`).
        self._call = stub.StepStream(iter(self._requests.get, _END), metadata=metadata)
        self.sent_at = 0.0  # monotonic time the step in flight was sent (0: none)
        self.timed_out = False

    def send(self, request: pb.StepRequest) -> pb.StepResponse:
        self.sent_at = time.monotonic()
        self._requests.put(request)
        try:
            return next(self._call)
        except StopIteration:
            raise _StreamBroken(
                grpc.StatusCode.UNAVAILABLE, "the step stream ended without an answer"
            ) from None
        except grpc.RpcError as err:
            if self.timed_out:
                raise _StreamBroken(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "no answer on the step stream within the deadline",
                ) from err
            if err.code() == grpc.StatusCode.CANCELLED:
                # not by us: the connection or the server went
                raise _StreamBroken(
                    grpc.StatusCode.UNAVAILABLE, f"the step stream was cut: {err.details()}"
                ) from err
            raise
        finally:
            self.sent_at = 0.0

    def cut(self) -> None:
        """Cancel the call (the watchdog: its step is past the deadline)."""
        self.timed_out = True
        self._call.cancel()

    def close(self) -> None:
        self._requests.put(_END)
        self._call.cancel()


class Caller:
    """Deadlines, metadata and retry-with-backoff around the stub of the
    address calls go to now (`Targets`), following the leader."""

    def __init__(
        self,
        targets: Targets,
        auth_token: str | None,
        deadline_s: float,
        retries: int,
        backoff_s: float,
        on_unavailable: Callable[[float, int], None] | None = None,
    ) -> None:
        self.targets = targets
        self._stubs: dict[str, Any] = {}
        self.metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
        self.deadline_s = deadline_s
        self.retries = retries
        self.backoff_s = backoff_s
        # With retries on, told (seconds, 1) after each failed attempt
        # (UNAVAILABLE, DEADLINE_EXCEEDED) and its backoff, and (seconds, 0)
        # for the attempt that got an answer after failures: the worker counts
        # them as its allocator stall.
        self.on_unavailable = on_unavailable

    @property
    def stub(self):
        """The Allocator stub of the address calls go to now."""
        address = self.targets.current
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = pb_grpc.AllocatorStub(self.targets.channel(address))
        return stub

    def _unavailable(self, t0: float, failed: int) -> None:
        if self.on_unavailable is not None:
            self.on_unavailable(time.monotonic() - t0, failed)

    def __call__(self, method: str, request, *, retry: bool = True, via: Callable | None = None):
        """`via(request)`: send it this way instead of a unary call (the step
        stream); its failures take the same retry path."""
        attempt = 0
        while True:
            t0 = time.monotonic()
            address = self.targets.current
            try:
                if via is not None:
                    response = via(request)
                else:
                    response = getattr(self.stub, method)(
                        request, timeout=self.deadline_s, metadata=self.metadata
                    )
            except grpc.RpcError as err:
                if not retry or not transient(err):
                    if not retry and transient(err):
                        # the next call (a heartbeat's) goes to the leader
                        self.targets.after_failure(address, err)
                    if attempt:
                        self._unavailable(t0, 0)
                    raise
                if attempt >= self.retries:
                    self._unavailable(t0, 1)
                    raise AllocatorUnavailable(
                        f"{method}: allocator unreachable after {attempt + 1} attempts: "
                        f"{err.code().name} {err.details()}"
                    ) from err
                now = self.targets.after_failure(address, err)
                cap = FAILOVER_BACKOFF_CAP_S if self.targets.several else 2.0
                delay = (
                    0.0
                    if now
                    else min(self.backoff_s * 2**attempt, cap) * (0.5 + random.random() / 2)
                )
                attempt += 1
                time.sleep(delay)
                self._unavailable(t0, 1)
                continue
            if attempt:
                self._unavailable(t0, 0)
            return response
