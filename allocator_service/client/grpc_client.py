"""`GrpcAllocator`: the AllocatorClient of a worker that shares the allocator
service with others.

Failure handling, in the order a worker meets it:

- UNAVAILABLE or DEADLINE_EXCEEDED (server restarting, Redis blip), or a
  call the transport cut with no answer from the allocator's code (`transport.transient`:
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
(`HOST:PORT,HOST:PORT`: `transport.Targets`); calls go to one at a time, and the
client follows the leader: a standby answers UNAVAILABLE `not_leader` with
the leader's address (`LEADER_KEY`), and the call is sent there at once; an
address that does not answer at all (the leader died) sends the call to the
next one, with a backoff capped at `transport.FAILOVER_BACKOFF_CAP_S`; and a step that
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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc

from allocator_service.client.base import AllocatorClient, PoolLost, PoolSpec
from allocator_service.client.transport import Caller, StepStream, Targets, error_reason
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
    decode_results,
    fill_ops,
    shape_to_proto,
    stats_from_proto,
)
from allocator_service.wire.errors import (
    CAPACITY,
    POOL_IN_USE,
    POOL_NOT_FOUND,
    STEP_STREAMS,
    UNKNOWN_SEQUENCE,
)
from allocator_service.wire.v1 import allocator_pb2 as pb

log = logging.getLogger(__name__)

OLDEST_OP_KINDS = frozenset((pb.OP_KIND_FREE, pb.OP_KIND_APPEND, pb.OP_KIND_ADMIT, pb.OP_KIND_FORK))


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
        self._targets = Targets(target, tls_ca)
        self._call = Caller(
            self._targets, auth_token, deadline_s, retries, backoff_s, on_unavailable
        )
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
        self._stream: StepStream | None = None
        self._watchdog: threading.Thread | None = None
        self._register(replace_credential)
        self._heartbeat: threading.Thread | None = None
        if heartbeat:
            self._heartbeat = threading.Thread(
                target=self._beat, name="allocator-heartbeat", daemon=True
            )
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
        return {
            "pool_id": ref.pool_id,
            "worker_id": self.spec.worker_id,
            "proof": proof(key, nonce, ref.pool_id, self.spec.advertise_url),
        }

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
                    log.warning(
                        "cannot register yet, retrying for up to %.0f s: %s",
                        self.register_wait_s,
                        err.details(),
                    )
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
            self.peer_key = r.peer_key  # a peer:// store: the key of this pool's group ...
            self.peer_store_bytes = r.shared_store_bytes  # ... and its capacity
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
                raise PoolLost(
                    f"pool {old} was dropped by the allocator; now {self._ref.pool_id}"
                ) from err
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
        response = self._pool_call(
            "Step", request, via=self._send_on_stream if self._use_stream else None
        )
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
            stream = self._stream = StepStream(self._call.stub, self._call.metadata)
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="allocator-step-watchdog", daemon=True
                )
                self._watchdog.start()
        try:
            return stream.send(request)
        except grpc.RpcError as err:
            self._stream = None
            stream.close()
            code = err.code()
            if code == grpc.StatusCode.UNIMPLEMENTED or (
                code == grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(err) == STEP_STREAMS
            ):
                # Refused before any request was read: nothing was applied.
                log.info(
                    "the allocator refused a step stream (%s): sending unary Steps", err.details()
                )
                self._use_stream = False
                return self._unary_step(request)
            raise

    def _unary_step(self, request: pb.StepRequest) -> pb.StepResponse:
        return self._call.stub.Step(
            request, timeout=self._call.deadline_s, metadata=self._call.metadata
        )

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
                log.warning(
                    "no answer on the step stream within %.1f s: retrying the step", deadline
                )
                stream.cut()
            elif targets.several and waited > self.failover_after_s:
                leader = targets.serving_elsewhere(timeout_s=min(self.failover_after_s, 0.5))
                if leader is not None and stream.sent_at == sent:
                    targets.use(leader, f"no answer for {waited:.1f} s and {leader} leads")
                    stream.cut()

    def stats(self) -> PoolStats:
        return stats_from_proto(
            self._pool_call("GetPoolStats", pb.GetPoolStatsRequest(pool=self._ref))
        )

    def block_table(self, seq_id: str) -> list[int]:
        try:
            r = self._pool_call(
                "GetBlockTable", pb.GetBlockTableRequest(pool=self._ref, seq_id=seq_id)
            )
        except grpc.RpcError as err:
            if error_reason(err) == UNKNOWN_SEQUENCE:
                raise UnknownSequence(seq_id) from err
            raise
        return list(r.block_ids)

    def reset_prefix_cache(self) -> int:
        return self._pool_call(
            "ResetPrefixCache", pb.ResetPrefixCacheRequest(pool=self._ref)
        ).dropped

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
        r = self._pool_call(
            "GetPoolStats", pb.GetPoolStatsRequest(pool=self._ref, check_integrity=True)
        )
        return list(r.integrity_problems)

    def dump(self) -> dict[str, Any]:
        return json.loads(
            self._pool_call("DumpPool", pb.DumpPoolRequest(pool=self._ref)).state_json
        )
