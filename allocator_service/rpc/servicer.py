"""The gRPC face of `AllocatorService`: unpack, call, pack. Nothing else:
the only place the service's requests and answers are protobuf.

Handlers are built here rather than with the generated
`add_AllocatorServicer_to_server` for one reason: the generated code parses
requests with `FromString`, and grpc turns a parse failure into INTERNAL.
Bytes a client sends must never produce INTERNAL, so requests go through a
deserializer that returns a `Malformed` marker instead, which becomes
INVALID_ARGUMENT in the same error path as everything else.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import grpc

from allocator_service.core.prefix_index import BLOCK_REMOVED, BLOCK_STORED
from allocator_service.core.step import KINDS
from allocator_service.fair_share import ROUTER
from allocator_service.roles import ADMIN, caller_role
from allocator_service.roles import ROUTER as ROUTER_ROLE
from allocator_service.rpc import status
from allocator_service.service import Advertised, AllocatorService, PoolRef
from allocator_service.store.events import Event
from allocator_service.wire.codec import (
    config_from_proto,
    match_to_proto,
    pool_info_to_proto,
    stats_to_proto,
    step_from_proto,
)
from allocator_service.wire.errors import BadRequest, ShuttingDown
from allocator_service.wire.v1 import allocator_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Allocator"].full_name

EVENT_KIND = {
    "block_stored": pb.KV_EVENT_KIND_BLOCK_STORED,
    "block_removed": pb.KV_EVENT_KIND_BLOCK_REMOVED,
    "all_cleared": pb.KV_EVENT_KIND_ALL_CLEARED,
    "pool_registered": pb.KV_EVENT_KIND_POOL_REGISTERED,
    "pool_dropped": pb.KV_EVENT_KIND_POOL_DROPPED,
}
WATCH_BATCH = 512
WATCH_POLL_S = 0.5
_KIND_NAME = {v: k for k, v in EVENT_KIND.items()}
_BLOCK_KINDS = frozenset((BLOCK_STORED, BLOCK_REMOVED))
# Sent whatever the kinds filter says (naming them is allowed).
ALWAYS_SENT = frozenset((pb.KV_EVENT_KIND_RESYNC_REQUIRED, pb.KV_EVENT_KIND_SNAPSHOT_END))
# A snapshot's blocks per POOL_CACHED event: 8,192 x (32 + ~3) bytes, well under
# gRPC's 4 MB message limit; a 65,536-block pool is 8 messages, not 65,536.
SNAPSHOT_BLOCKS = 8192
# Kinds that only stand for others packed (a snapshot's, a packed stream's);
# naming them is allowed.
_PACKED_KINDS = frozenset((pb.KV_EVENT_KIND_POOL_CACHED, pb.KV_EVENT_KIND_BLOCKS_CHANGED))


def watched_kinds(kinds) -> frozenset[str] | None:
    """WatchEventsRequest.kinds as the event log's kind names; None = every
    kind. RESYNC_REQUIRED and SNAPSHOT_END may be named (they are sent anyway);
    BLOCKS_CHANGED stands for the block events it packs, POOL_CACHED for a
    snapshot's blocks; anything else that is not an event kind is refused."""
    if not kinds:
        return None
    unknown = [
        k for k in kinds if k not in _KIND_NAME and k not in ALWAYS_SENT and k not in _PACKED_KINDS
    ]
    if unknown:
        raise BadRequest(
            f"kinds: {unknown} are not event kinds (one of "
            f"{sorted(k for k in pb.KvEventKind.values() if k != pb.KV_EVENT_KIND_UNSPECIFIED)})"
        )
    names = {_KIND_NAME[k] for k in kinds if k in _KIND_NAME}
    if pb.KV_EVENT_KIND_BLOCKS_CHANGED in kinds:  # what a packed run carries
        names |= _BLOCK_KINDS
    return frozenset(names)


def event_message(e: Event) -> pb.KvEvent:
    return pb.KvEvent(
        sequence=e.sequence,
        kind=EVENT_KIND[e.kind],
        pool_id=e.pool_id,
        block_id=e.block_id,
        block_hash=e.block_hash,
        model_fingerprint=e.model_fingerprint,
        reason=e.reason,
        worker_id=e.worker_id,
        advertise_url=e.advertise_url,
        served_model_name=e.served_model_name,
    )


def packed_events(
    events: Iterable[Event], free_blocks: Callable[[str], int | None]
) -> Iterator[pb.KvEvent]:
    """`events` as messages, each run of consecutively numbered block events
    of one pool as one BLOCKS_CHANGED (a run of one stays a plain event),
    each with the pool's free blocks now (`free_blocks(pool_id)`)."""
    run: list[Event] = []

    def flush() -> Iterator[pb.KvEvent]:
        if run:
            first = run[0]
            if len(run) == 1:
                message = event_message(first)
            else:
                message = pb.KvEvent(
                    sequence=first.sequence,
                    kind=pb.KV_EVENT_KIND_BLOCKS_CHANGED,
                    pool_id=first.pool_id,
                    block_ids=[e.block_id for e in run],
                    block_hashes=b"".join(e.block_hash for e in run),
                    removed=[e.kind == BLOCK_REMOVED for e in run],
                )
            free = free_blocks(first.pool_id)
            if free is not None:
                message.free_blocks = free
            yield message
        run.clear()

    for e in events:
        if e.kind in _BLOCK_KINDS:
            if run and (e.pool_id != run[0].pool_id or e.sequence != run[-1].sequence + 1):
                yield from flush()
            run.append(e)
        else:
            yield from flush()
            yield event_message(e)
    yield from flush()


def pool_ref(msg: pb.PoolRef) -> PoolRef:
    return PoolRef(msg.pool_id, msg.credential)


class AllocatorServicer:
    def __init__(self, service: AllocatorService) -> None:
        self.service = service

    def RegisterPool(self, request: pb.RegisterPoolRequest, context) -> pb.RegisterPoolResponse:
        r = self.service.pools.register(
            request.worker_id,
            config_from_proto(request.shape),
            request.replace_credential,
            Advertised(request.advertise_url, request.served_model_name),
            request.protocol_version,
        )
        return pb.RegisterPoolResponse(
            pool_id=r.pool_id,
            epoch=r.epoch,
            credential=r.credential,
            lease_ttl_s=r.lease_ttl_s,
            op_kinds=KINDS,
            shared_store=r.shared_store,
            store_namespace=r.store_namespace,
            peer_key=r.peer_key,
            shared_store_bytes=r.peer_store_bytes,
        )

    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(
            lease_ttl_s=self.service.pools.heartbeat(pool_ref(request.pool))
        )

    def DeregisterPool(
        self, request: pb.DeregisterPoolRequest, context
    ) -> pb.DeregisterPoolResponse:
        self.service.pools.deregister(pool_ref(request.pool))
        return pb.DeregisterPoolResponse()

    def Step(self, request: pb.StepRequest, context) -> pb.StepResponse:
        prev = request.prev_step_id if request.HasField("prev_step_id") else None
        return self.service.steps.step(
            pool_ref(request.pool), request.step_id, *step_from_proto(request.ops), prev
        )

    def StepStream(self, requests: Iterator[pb.StepRequest], context) -> Iterator[pb.StepResponse]:
        """Step, once per request on one long-lived call. The first failing
        request ends the stream with Step's status for it (`_bidi`). Ended
        at shutdown (`_StreamEnd`), a stream answers the step in flight
        before it closes; a request read after that is refused, unapplied
        (UNAVAILABLE: the worker sends it to the next server)."""
        service = self.service
        end = _StreamEnd(context.cancel)
        service.streams.open_step_stream(end.end)
        try:
            for request in requests:
                if type(request) is Malformed:
                    raise BadRequest(f"malformed StepStream request: {request.error}")
                if not end.begin():
                    raise ShuttingDown("the allocator is shutting down")
                with service.fair.call(request.pool.pool_id):  # each step is a call of its own
                    response = self.Step(request, context)
                yield response  # resumed once it is sent
                if end.answered():
                    return
        finally:
            service.streams.close_step_stream(end.end)

    def GetBlockTable(self, request: pb.GetBlockTableRequest, context) -> pb.GetBlockTableResponse:
        table, num_tokens = self.service.reads.block_table(pool_ref(request.pool), request.seq_id)
        return pb.GetBlockTableResponse(block_ids=table, num_tokens=num_tokens)

    def GetPoolStats(self, request: pb.GetPoolStatsRequest, context) -> pb.GetPoolStatsResponse:
        r = self.service.reads.stats(
            pool_ref(request.pool), request.check_integrity, admin=caller_role() == ADMIN
        )
        return stats_to_proto(
            r.stats,
            last_step_id=r.last_step_id,
            integrity_problems=r.integrity_problems,
            integrity_checked=r.integrity_checked,
        )

    def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context
    ) -> pb.ResetPrefixCacheResponse:
        dropped = self.service.steps.reset_prefix_cache(
            pool_ref(request.pool), admin=caller_role() == ADMIN
        )
        return pb.ResetPrefixCacheResponse(dropped=dropped)

    def MatchPrefix(self, request: pb.MatchPrefixRequest, context) -> pb.MatchPrefixResponse:
        salt = request.cache_salt if request.HasField("cache_salt") else None
        matches = self.service.reads.match_prefix(
            request.model_fingerprint, list(request.tokens), salt
        )
        return pb.MatchPrefixResponse(matches=[match_to_proto(m) for m in matches])

    def ListPools(self, request: pb.ListPoolsRequest, context) -> pb.ListPoolsResponse:
        pools = self.service.reads.list_pools(request.model_fingerprint)
        return pb.ListPoolsResponse(pools=[pool_info_to_proto(p) for p in pools])

    def DumpPool(self, request: pb.DumpPoolRequest, context) -> pb.DumpPoolResponse:
        state_json, last_step_id, problems = self.service.reads.dump(
            pool_ref(request.pool), admin=caller_role() == ADMIN
        )
        return pb.DumpPoolResponse(
            state_json=state_json,
            last_step_id=last_step_id,
            integrity_problems=problems,
        )

    def WatchEvents(self, request: pb.WatchEventsRequest, context) -> Iterator[pb.KvEvent]:
        service = self.service
        log = service.events
        wanted = watched_kinds(request.kinds)
        if request.snapshot and request.from_sequence:
            raise BadRequest("snapshot starts from the present: send from_sequence 0 with it")
        router = caller_role() == ROUTER_ROLE  # a place kept for routers
        service.streams.open_watcher(router)
        try:
            cursor = request.from_sequence or log.published
            if request.snapshot:  # the present first, then everything numbered from `cursor` on
                blocks = (
                    wanted is None
                    or BLOCK_STORED in wanted
                    or pb.KV_EVENT_KIND_POOL_CACHED in request.kinds
                )
                for pool_id, ids, hashes in (
                    service.reads.cached_blocks(SNAPSHOT_BLOCKS) if blocks else ()
                ):
                    yield pb.KvEvent(
                        kind=pb.KV_EVENT_KIND_POOL_CACHED,
                        pool_id=pool_id,
                        block_ids=ids,
                        block_hashes=b"".join(hashes),
                        free_blocks=service.reads.free_blocks(pool_id),
                    )
                yield pb.KvEvent(sequence=cursor, kind=pb.KV_EVENT_KIND_SNAPSHOT_END)
            while context.is_active() and not service.stopping and not log.closed:
                batch, after, gap = log.read(cursor, WATCH_BATCH, WATCH_POLL_S)
                if gap:
                    yield pb.KvEvent(
                        sequence=after - len(batch), kind=pb.KV_EVENT_KIND_RESYNC_REQUIRED
                    )
                events = (e for e in batch if wanted is None or e.kind in wanted)
                yield from (
                    packed_events(events, service.reads.free_blocks)
                    if request.packed
                    else map(event_message, events)
                )
                cursor = after
        finally:
            service.streams.close_watcher(router)


class _StreamEnd:
    """How a StepStream ends at shutdown: at once while idle (it waits for
    its worker's next step, which may never come), else right after the
    answer to the step in flight has been sent, so no applied step loses
    its answer to the shutdown."""

    def __init__(self, cancel: Callable[[], Any]) -> None:
        self._cancel = cancel
        self._lock = threading.Lock()
        self._busy = False
        self._ended = False

    def end(self) -> None:
        with self._lock:
            self._ended = True
            if not self._busy:
                self._cancel()

    def begin(self) -> bool:
        """A step arrived: False once ended (it must not be applied)."""
        with self._lock:
            self._busy = not self._ended
            return self._busy

    def answered(self) -> bool:
        """Its answer was sent: whether the stream must end now."""
        with self._lock:
            self._busy = False
            return self._ended


# ------------------------------------------------------------- registration
class Malformed(NamedTuple):
    """Stands in for a request whose bytes did not parse."""

    error: str


def _safe_parser(cls) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as exc:  # any parse failure is the sender's fault
            return Malformed(str(exc) or type(exc).__name__)

    return parse


def _tenant(method: str) -> Callable[[Any], tuple[str, bool]] | None:
    """Who a unary call of `method` is charged to in the CPU fair share
    (`fair_share.py`), and whether it is a pool call; None: not scheduled.
    A call is charged to the pool it names: one naming a pool without its
    credential is refused before any long work, so it can charge that pool
    only the cost of a refusal."""
    if method == "Heartbeat":
        return None  # a dict lookup and an HMAC: never made to wait
    if method == "RegisterPool":
        return lambda request: (f"worker {request.worker_id}", True)
    fields = getattr(
        pb, pb.DESCRIPTOR.services_by_name["Allocator"].methods_by_name[method].input_type.name
    )
    if "pool" in fields.DESCRIPTOR.fields_by_name:
        return lambda request: (request.pool.pool_id, True)
    return lambda request: (ROUTER, False)


# A pool's calls that can take long (an integrity check, a dump of a large
# pool) and that a worker makes beside its steps: at most
# `Limits.max_calls_per_pool` of them in flight per pool and `Limits.max_slow_calls`
# over every pool (`fair_share.CallSlots`).
# Not Step (ordered by step ids, and the step stream's fallback), Heartbeat,
# RegisterPool or DeregisterPool (short, and a refusal would cost the worker
# its pool or its lease), nor an admin's or a router's calls (trusted roles).
SLOTTED = frozenset(("GetBlockTable", "GetPoolStats", "ResetPrefixCache", "DumpPool"))


def _unary(name: str, fn: Callable, service: AllocatorService) -> Callable:
    tenant = _tenant(name)
    fair, slots, slotted = service.fair, service.call_slots, name in SLOTTED

    def handle(request, context):
        try:
            if type(request) is Malformed:
                raise BadRequest(f"malformed {name} request: {request.error}")
            if tenant is None:
                return fn(request, context)
            who, pool_call = tenant(request)
            if slotted and caller_role() != ADMIN:
                # the credential first: a caller without it must not take the pool's slots
                service.changes.authorize(pool_ref(request.pool))
                with slots.take(who), fair.call(who, long=True):
                    return fn(request, context)
            # (slow reads and a router's calls: short turns from their start)
            with fair.call(who, pool_call=pool_call, long=slotted or not pool_call):
                return fn(request, context)
        except Exception as exc:
            status.abort(context, exc, name)

    return handle


def _stream(name: str, fn: Callable) -> Callable:
    def handle(request, context):
        try:
            if type(request) is Malformed:
                raise BadRequest(f"malformed {name} request: {request.error}")
            yield from fn(request, context)
        except Exception as exc:
            status.abort(context, exc, name)

    return handle


def _bidi(name: str, fn: Callable) -> Callable:
    def handle(requests, context):
        try:
            yield from fn(requests, context)
        except grpc.RpcError:
            return  # the request iterator's: the call was cancelled (client gone, or shutdown)
        except Exception as exc:
            status.abort(context, exc, name)

    return handle


def allocator_handler(service: AllocatorService) -> grpc.GenericRpcHandler:
    """The Allocator service's handlers, with safe parsing and error mapping."""
    servicer = AllocatorServicer(service)
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Allocator"].methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        fn = getattr(servicer, method.name)
        if method.client_streaming and method.server_streaming:
            make, wrap = grpc.stream_stream_rpc_method_handler, _bidi
        elif method.server_streaming:
            make, wrap = grpc.unary_stream_rpc_method_handler, _stream
        else:
            make, wrap = (
                grpc.unary_unary_rpc_method_handler,
                functools.partial(_unary, service=service),
            )
        handlers[method.name] = make(
            wrap(method.name, fn),
            request_deserializer=_safe_parser(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
