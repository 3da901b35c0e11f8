"""`GrpcAllocator`: the AllocatorClient of a worker that shares the allocator
service with others.

Failure handling, in the order a worker meets it:

- UNAVAILABLE or DEADLINE_EXCEEDED (server restarting, Redis blip), or a
  call the transport cut with no answer from the allocator's code (`transient`:
  CANCELLED, UNKNOWN or INTERNAL without the server's `pagedkv-error` reason):
  the SAME request, with the same step id, is sent again after an
  exponential backoff with jitter. The server applies a step id once and answers a retry of it
  with the first answer, so a step that did land is never applied twice.
  When every retry fails, `AllocatorUnavailable` is raised; calling `step`
  again with the same operations reuses the pending step id, so the worker
  can simply retry without knowing whether the first attempt landed (its
  scheduler does, until the allocator answers: the worker stalls, nothing
  fails). `on_unavailable(seconds, failed)` is told the time lost. A
  RESOURCE_EXHAUSTED `pool_calls` (the pool's slow calls already in flight
  at the server) is retried the same way: it asks to wait, not to fail.
- The pool is gone (lease expired, server restarted without durable state,
  or the server's journal lost a step this client got an answer for): the
  client registers a fresh pool (a new epoch) and raises `PoolLost`; every
  sequence the worker held is gone and must be recomputed. Each Step names
  the last step id answered (`prev_step_id`), which is how the server tells
  that its state is behind the worker's.
- The worker id still has a live pool when registering (a restarted worker
  process whose previous pool's lease has not yet run out): the server
  refuses (`pool_in_use`) unless given that pool's credential, so the client
  waits, retrying, for the old lease to expire (`register_wait_s`; as it
  does while the server has no room for the pool, `capacity`), then
  raises the refusal.
- Anything else is a bug on one side and surfaces as `grpc.RpcError`.

A daemon thread renews the lease at a third of its TTL while the worker is
idle (every call renews it too).

An allocator with a hot standby (`--standby`) has several addresses
(`HOST:PORT,HOST:PORT`: `_Targets`); calls go to one at a time, and the
client follows the leader: a standby answers UNAVAILABLE `not_leader` with
the leader's address (`LEADER_KEY`), and the call is sent there at once; an
address that does not answer at all (the leader died) sends the call to the
next one, with a backoff capped at `FAILOVER_BACKOFF_CAP_S`; and a step that
waits longer than `failover_after_s` on the step stream (a leader paused,
SIGSTOP, whose lease a standby then takes) makes the watchdog ask the other
addresses' health which one serves, and resend the step there. A step sent
again to the new leader keeps its step id: the answer is the one already
journaled if the old leader had journaled it, and the old leader can no
longer write (its writes are fenced), so nothing is applied twice.

Steps go over one long-lived `StepStream` call (`step_stream=True`, the
default): the same requests and answers as unary `Step`, minus a call's
setup per step. Everything above holds for it unchanged: a stream that
fails (the server's error for that step, a restart, a broken connection)
is dropped and the step goes through the same retry path with the same step
id, on a new stream. The deadline of a step on the stream is enforced by a
watchdog thread (within a quarter of the deadline, at most 0.25 s late):
it cancels the stream, and the step is retried as DEADLINE_EXCEEDED. A
server that refuses the stream (every one of its `max_step_streams` taken,
or an older server without the method) gets unary Steps from then on.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import grpc

from allocator_service.client.base import AllocatorClient, AllocatorUnavailable, PoolLost, PoolSpec
from allocator_service.core import (
    InvalidArgument,
    Op,
    PoolStats,
    StepAnswer,
    UnknownSequence,
    step_columns,
)
from allocator_service.core.tiers import TierReport
from allocator_service.wire.attest import attest_key, credential_digest, proof
from allocator_service.wire.codec import (
    PROTOCOL_VERSION,
    PoolInfo,
    PrefixMatch,
    decode_results,
    fill_ops,
    match_from_proto,
    pool_info_from_proto,
    shape_to_proto,
    stats_from_proto,
)
from allocator_service.wire.errors import (
    CAPACITY,
    ERROR_KEY,
    LEADER_KEY,
    NOT_LEADER,
    POOL_CALLS,
    POOL_IN_USE,
    POOL_NOT_FOUND,
    STEP_STREAMS,
    UNKNOWN_SEQUENCE,
)
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import allocator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
OLDEST_OP_KINDS = frozenset((pb.OP_KIND_FREE, pb.OP_KIND_APPEND, pb.OP_KIND_ADMIT, pb.OP_KIND_FORK))
# Refusals that mean "not now": retried the same way (the pool's slow calls in flight).
RETRYABLE_REASONS = (POOL_CALLS,)
# How gRPC ends a call that the allocator's code never answered (no
# `pagedkv-error` reason): the connection, a proxy or the server's shutdown
# cut it. Besides UNAVAILABLE, gRPC reports a transport torn down mid-call
# as UNKNOWN ("Stream removed", grpc/grpc#34076) or INTERNAL (a peer's
# RST_STREAM), and a call the stopping server cancelled as CANCELLED.
TRANSPORT = frozenset((*RETRYABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL))

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
    return kind.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=tls_ca), options=opts)


class _Targets:
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
                    return False  # it names a leader that just did not answer: its lease runs out; stay
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
                    health_pb2.HealthCheckRequest(service=name), timeout=timeout_s)
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


class _StepStream:
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
            raise _StreamBroken(grpc.StatusCode.UNAVAILABLE, "the step stream ended without an answer") from None
        except grpc.RpcError as err:
            if self.timed_out:
                raise _StreamBroken(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "no answer on the step stream within the deadline") from err
            if err.code() == grpc.StatusCode.CANCELLED:  # not by us: the connection or the server went
                raise _StreamBroken(grpc.StatusCode.UNAVAILABLE, f"the step stream was cut: {err.details()}") from err
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


class _Caller:
    """Deadlines, metadata and retry-with-backoff around the stub of the
    address calls go to now (`_Targets`), following the leader."""

    def __init__(self, targets: _Targets, auth_token: str | None, deadline_s: float, retries: int,
                 backoff_s: float, on_unavailable: Callable[[float, int], None] | None = None) -> None:
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
                    response = getattr(self.stub, method)(request, timeout=self.deadline_s, metadata=self.metadata)
            except grpc.RpcError as err:
                if not retry or not transient(err):
                    if not retry and transient(err):
                        self.targets.after_failure(address, err)  # the next call (a heartbeat's) goes to the leader
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
                delay = 0.0 if now else min(self.backoff_s * 2**attempt, cap) * (0.5 + random.random() / 2)
                attempt += 1
                time.sleep(delay)
                self._unavailable(t0, 1)
                continue
            if attempt:
                self._unavailable(t0, 0)
            return response


class GrpcAllocator(AllocatorClient):
    """One worker's pool at a remote allocator. Registers on construction."""

    def __init__(
        self,
        target: str,
        spec: PoolSpec,
        *,
        auth_token: str | None = None,
        tls_ca: str | bytes | None = None,
        deadline_s: float = 5.0,
        retries: int = 10,
        backoff_s: float = 0.05,
        heartbeat: bool = True,
        on_unavailable: Callable[[float, int], None] | None = None,
        replace_credential: str = "",
        register_wait_s: float = 120.0,
        step_stream: bool = True,
        failover_after_s: float = 0.3,
    ) -> None:
        """`target`: the allocator's address, or its addresses
        (`HOST:PORT,HOST:PORT`: a leader and its standbys, followed as the
        module docstring says). `step_stream`: send steps over one long-lived StepStream call
        (see the module docstring) rather than one unary Step each;
        `failover_after_s`: with several addresses, a step unanswered this
        long makes the client ask the others whether one leads now.

        KV tiers: the pool's shape asks for them (`spec.config`); the
        allocator answers with its shared store's URL (`shared_store`), or
        registers the pool without the store when it has none (`spec` then
        says `use_shared_store` False), as `EmbeddedAllocator` does."""
        self.spec = spec
        self._asked = spec  # what every registration asks for
        self.register_wait_s = register_wait_s
        self.block_size = spec.config.block_size
        self._targets = _Targets(target, tls_ca)
        self._call = _Caller(self._targets, auth_token, deadline_s, retries, backoff_s, on_unavailable)
        self.failover_after_s = failover_after_s
        self._register_lock = threading.Lock()
        self._ref = pb.PoolRef()
        self.epoch = 0
        self.lease_ttl_s = 0.0
        self._step_id = 0
        self._answered = 0  # the last step id that got an answer
        self._pending: pb.StepRequest | None = None  # sent, outcome unknown
        self._closed = threading.Event()
        self._use_stream = step_stream
        self._stream: _StepStream | None = None
        self._watchdog: threading.Thread | None = None
        self._register(replace_credential)
        self._heartbeat: threading.Thread | None = None
        if heartbeat:
            self._heartbeat = threading.Thread(target=self._beat, name="allocator-heartbeat", daemon=True)
            self._heartbeat.start()

    @property
    def pool_id(self) -> str:
        return self._ref.pool_id

    def identity(self, nonce: str) -> dict[str, str] | None:
        if not self.spec.advertise_url:
            return None  # not listed with an address: no router is sent here by the allocator
        with self._register_lock:
            ref = self._ref
        if not ref.pool_id:
            return None
        key = attest_key(credential_digest(ref.credential))
        return {"pool_id": ref.pool_id, "worker_id": self.spec.worker_id,
                "proof": proof(key, nonce, ref.pool_id, self.spec.advertise_url)}

    # ---------------------------------------------------------------- pool
    def _register(self, replace_credential: str = "") -> None:
        """Register a pool, replacing the worker id's live pool only with its
        credential; else wait up to `register_wait_s` for that pool to go."""
        request = pb.RegisterPoolRequest(
            worker_id=self.spec.worker_id,
            shape=shape_to_proto(self._asked.config),
            replace_credential=replace_credential,
            advertise_url=self.spec.advertise_url,
            served_model_name=self.spec.served_model_name,
            protocol_version=PROTOCOL_VERSION,  # every Step carries prev_step_id
        )
        give_up = time.monotonic() + self.register_wait_s
        waited = 0
        while True:
            try:
                r = self._call("RegisterPool", request)
                break
            except grpc.RpcError as err:
                # A live pool of this id (its lease runs out), or no room yet (a pool may go): wait.
                if error_reason(err) not in (POOL_IN_USE, CAPACITY) or time.monotonic() >= give_up:
                    raise
                if not waited:
                    log.warning("cannot register yet, retrying for up to %.0f s: %s", self.register_wait_s,
                                err.details())
                waited += 1
                time.sleep(min(0.5 * 2 ** (waited - 1), 5.0, max(give_up - time.monotonic(), 0.0)))
        with self._register_lock:
            self._ref = pb.PoolRef(pool_id=r.pool_id, credential=r.credential)
            self.epoch = r.epoch
            self.lease_ttl_s = r.lease_ttl_s
            # (an allocator from before `op_kinds` applies the first four kinds)
            self.op_kinds = frozenset(r.op_kinds) or OLDEST_OP_KINDS
            self.shared_store = r.shared_store or None
            config = self._asked.config
            # (an allocator from before store groups keys a pool's entries by its layout)
            self.store_namespace = (r.store_namespace or config.layout) if r.shared_store else ""
            if config.use_shared_store and not r.shared_store:
                self.spec = replace(self._asked, config=replace(config, use_shared_store=False))
            else:
                self.spec = self._asked
            self._step_id = 0
            self._answered = 0
            self._pending = None

    def _pool_call(self, method: str, request, via: Callable | None = None):
        """A call on our pool; a vanished pool becomes PoolLost (after
        registering a fresh one)."""
        try:
            return self._call(method, request, via=via)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND and error_reason(err) == POOL_NOT_FOUND:
                old = request.pool.pool_id
                if old == self._ref.pool_id:  # else another thread registered a fresh pool already
                    self._register()
                log.warning("allocator pool %s was dropped; registered %s", old, self._ref.pool_id)
                raise PoolLost(f"pool {old} was dropped by the allocator; now {self._ref.pool_id}") from err
            raise

    def _beat(self) -> None:
        while not self._closed.wait(max(self.lease_ttl_s / 3, 0.05)):
            try:
                self._call("Heartbeat", pb.HeartbeatRequest(pool=self._ref), retry=False)
            except grpc.RpcError as err:
                # The engine's next call handles a lost pool; keep beating.
                log.debug("heartbeat: %s", err.code().name)

    # ------------------------------------------------------ AllocatorClient
    def step(self, ops: Sequence[Op], report: TierReport | None = None) -> StepAnswer:
        request = pb.StepRequest(pool=self._ref, prev_step_id=self._answered)
        try:
            fill_ops(request.ops, step_columns(ops, report))  # in place: no copy of the columns
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"cannot encode the step: {exc}") from exc
        pending = self._pending
        if pending is not None and pending.ops == request.ops:
            request = pending  # the same operations again: the same step id
        else:
            self._step_id += 1
            request.step_id = self._step_id
        self._pending = request
        response = self._pool_call("Step", request, via=self._send_on_stream if self._use_stream else None)
        self._pending = None
        self._answered = request.step_id
        return decode_results(response, len(ops))

    # ----------------------------------------------------------- the stream
    def _send_on_stream(self, request: pb.StepRequest) -> pb.StepResponse:
        """One step on the step stream, opened on first use and after a
        failure. Any failure drops the stream and is raised for the caller's
        retry; a refused stream sends this and every later step unary."""
        if not self._use_stream:  # refused earlier in this call's retries
            return self._unary_step(request)
        stream = self._stream
        if stream is None:
            stream = self._stream = _StepStream(self._call.stub, self._call.metadata)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="allocator-step-watchdog", daemon=True)
                self._watchdog.start()
        try:
            return stream.send(request)
        except grpc.RpcError as err:
            self._stream = None
            stream.close()
            code = err.code()
            if code == grpc.StatusCode.UNIMPLEMENTED or (
                    code == grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(err) == STEP_STREAMS):
                # Refused before any request was read: nothing was applied.
                log.info("the allocator refused a step stream (%s): sending unary Steps", err.details())
                self._use_stream = False
                return self._unary_step(request)
            raise

    def _unary_step(self, request: pb.StepRequest) -> pb.StepResponse:
        return self._call.stub.Step(request, timeout=self._call.deadline_s, metadata=self._call.metadata)

    def _watch(self) -> None:
        """The step stream's deadline: cut a stream whose step has waited
        longer than the deadline (its step is then retried). With several
        addresses, a step waiting longer than `failover_after_s` makes it
        ask the others whether one leads now: the stream is then cut and
        the step retried there."""
        deadline = self._call.deadline_s
        targets = self._targets
        tick = min(deadline / 4, 0.25, self.failover_after_s / 3 if targets.several else 0.25)
        while not self._closed.wait(tick):
            stream = self._stream
            sent = stream.sent_at if stream is not None else 0.0
            if not sent:
                continue
            waited = time.monotonic() - sent
            if waited > deadline:
                log.warning("no answer on the step stream within %.1f s: retrying the step", deadline)
                stream.cut()
            elif targets.several and waited > self.failover_after_s:
                leader = targets.serving_elsewhere(timeout_s=min(self.failover_after_s, 0.5))
                if leader is not None and stream.sent_at == sent:
                    targets.use(leader, f"no answer for {waited:.1f} s and {leader} leads")
                    stream.cut()

    def stats(self) -> PoolStats:
        return stats_from_proto(self._pool_call("GetPoolStats", pb.GetPoolStatsRequest(pool=self._ref)))

    def block_table(self, seq_id: str) -> list[int]:
        try:
            r = self._pool_call("GetBlockTable", pb.GetBlockTableRequest(pool=self._ref, seq_id=seq_id))
        except grpc.RpcError as err:
            if error_reason(err) == UNKNOWN_SEQUENCE:
                raise UnknownSequence(seq_id) from err
            raise
        return list(r.block_ids)

    def reset_prefix_cache(self) -> int:
        return self._pool_call("ResetPrefixCache", pb.ResetPrefixCacheRequest(pool=self._ref)).dropped

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        try:
            self._call("DeregisterPool", pb.DeregisterPoolRequest(pool=self._ref), retry=False)
        except grpc.RpcError as err:
            log.debug("deregister on close: %s", err.code().name)
        for thread in (self._heartbeat, self._watchdog):
            if thread is not None:
                thread.join(timeout=2)
        self._targets.close()

    # -------------------------------------------------- beyond the interface
    def integrity_problems(self) -> list[str]:
        r = self._pool_call("GetPoolStats", pb.GetPoolStatsRequest(pool=self._ref, check_integrity=True))
        return list(r.integrity_problems)

    def dump(self) -> dict[str, Any]:
        return json.loads(self._pool_call("DumpPool", pb.DumpPoolRequest(pool=self._ref)).state_json)


class RouterClient:
    """The cross-pool calls a router makes: MatchPrefix, WatchEvents and ListPools."""

    def __init__(
        self,
        target: str,
        *,
        router_token: str | None = None,
        auth_token: str | None = None,
        tls_ca: str | bytes | None = None,
        deadline_s: float = 5.0,
        retries: int = 3,
    ) -> None:
        """`router_token` (or the admin token) is what MatchPrefix, WatchEvents
        and ListPools need once the server has a router token; `auth_token` is
        sent when no router token is given (a server with no router token
        and no server-wide token answers anyone)."""
        self._tls_ca = tls_ca
        # `target`: one allocator's addresses, a leader and its standbys (followed as GrpcAllocator does)
        self._targets = _Targets(target, tls_ca)
        self._call = _Caller(self._targets, router_token or auth_token, deadline_s, retries, 0.05)
        # (address, grpc.aio channel, its stub): made in the loop that uses it, for the address calls go to
        self._aio: tuple[str, Any, Any] | None = None

    def match_prefix(self, model_fingerprint: str, tokens: Sequence[int], cache_salt: str | None = None) -> list[PrefixMatch]:
        r = self._call("MatchPrefix", self._match_request(model_fingerprint, tokens, cache_salt))
        return self._matches(r)

    async def match_prefix_async(self, model_fingerprint: str, tokens: Sequence[int],
                                 cache_salt: str | None = None) -> list[PrefixMatch]:
        """`match_prefix` from an event loop, on a `grpc.aio` channel: one
        attempt (a router routes by load rather than wait), no thread hop.
        Call `aclose` from the same loop when done."""
        address = self._targets.current
        if self._aio is None or self._aio[0] != address:
            await self.aclose()
            channel = open_channel(address, self._tls_ca, aio=True)
            self._aio = (address, channel, pb_grpc.AllocatorStub(channel))
        try:
            r = await self._aio[2].MatchPrefix(self._match_request(model_fingerprint, tokens, cache_salt),
                                               timeout=self._call.deadline_s, metadata=self._call.metadata)
        except grpc.RpcError as err:
            if transient(err):
                self._targets.after_failure(address, err)  # the next call goes to the leader
            raise
        return self._matches(r)

    @staticmethod
    def _match_request(model_fingerprint: str, tokens: Sequence[int], cache_salt: str | None) -> pb.MatchPrefixRequest:
        return pb.MatchPrefixRequest(model_fingerprint=model_fingerprint, tokens=tokens, cache_salt=cache_salt)

    @staticmethod
    def _matches(r: pb.MatchPrefixResponse) -> list[PrefixMatch]:
        return [match_from_proto(m) for m in r.matches]

    def list_pools(self, model_fingerprint: str = "") -> list[PoolInfo]:
        """Every live pool (of `model_fingerprint`, when given), by pool id."""
        r = self._call("ListPools", pb.ListPoolsRequest(model_fingerprint=model_fingerprint))
        return [pool_info_from_proto(p) for p in r.pools]

    def watch_events(self, from_sequence: int = 0, timeout_s: float | None = None,
                     kinds: Sequence[int] = (), snapshot: bool = False, packed: bool = False) -> Iterator[pb.KvEvent]:
        """KV events from `from_sequence` (0 = from now), only of `kinds` if
        given (KvEventKind values). A KV_EVENT_KIND_RESYNC_REQUIRED event says
        events were missed; the stream goes on after it. `snapshot`: first
        every pool's cached blocks (POOL_CACHED, sequence 0), then
        KV_EVENT_KIND_SNAPSHOT_END, then the events from now. `packed`: runs
        of one pool's block events as single BLOCKS_CHANGED events."""
        address = self._targets.current
        call = self._call.stub.WatchEvents(
            pb.WatchEventsRequest(from_sequence=from_sequence, kinds=kinds, snapshot=snapshot, packed=packed),
            timeout=timeout_s,
            metadata=self._call.metadata,
        )
        return _Followed(call, self._targets, address) if self._targets.several else call

    async def aclose(self) -> None:
        """Closes the `grpc.aio` channel of `match_prefix_async` (from its loop)."""
        if self._aio is not None:
            channel, self._aio = self._aio[1], None
            await channel.close()

    def close(self) -> None:
        self._targets.close()


class _Followed:
    """A WatchEvents stream of one of several addresses: a transient failure
    moves the router's calls on to the leader (`_Targets.after_failure`)
    before it reaches the caller, who opens the stream again."""

    def __init__(self, call, targets: _Targets, address: str) -> None:
        self._call, self._targets, self._address = call, targets, address

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._call)
        except grpc.RpcError as err:
            if transient(err):
                self._targets.after_failure(self._address, err)
            raise

    def cancel(self) -> None:
        self._call.cancel()
