"""`RouterClient`: the cross-pool calls a router makes (MatchPrefix,
WatchEvents, ListPools), following one allocator's leader as `GrpcAllocator`
does."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from allocator_service.client.transport import Caller, Targets, open_channel, transient
from allocator_service.wire.codec import (
    PoolInfo,
    PrefixMatch,
    match_from_proto,
    pool_info_from_proto,
)
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import allocator_pb2_grpc as pb_grpc


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
        # `target`: one allocator's addresses, a leader and
        # its standbys (followed as GrpcAllocator does)
        self._targets = Targets(target, tls_ca)
        self._call = Caller(self._targets, router_token or auth_token, deadline_s, retries, 0.05)
        # (address, grpc.aio channel, its stub): made in the
        # loop that uses it, for the address calls go to
        self._aio: tuple[str, Any, Any] | None = None

    def match_prefix(
        self, model_fingerprint: str, tokens: Sequence[int], cache_salt: str | None = None
    ) -> list[PrefixMatch]:
        r = self._call("MatchPrefix", self._match_request(model_fingerprint, tokens, cache_salt))
        return self._matches(r)

    async def match_prefix_async(
        self, model_fingerprint: str, tokens: Sequence[int], cache_salt: str | None = None
    ) -> list[PrefixMatch]:
        """`match_prefix` from an event loop, on a `grpc.aio` channel: one
        attempt (a router routes by load rather than wait), no thread hop.
        Call `aclose` from the same loop when done."""
        address = self._targets.current
        if self._aio is None or self._aio[0] != address:
            await self.aclose()
            channel = open_channel(address, self._tls_ca, aio=True)
            self._aio = (address, channel, pb_grpc.AllocatorStub(channel))
        try:
            r = await self._aio[2].MatchPrefix(
                self._match_request(model_fingerprint, tokens, cache_salt),
                timeout=self._call.deadline_s,
                metadata=self._call.metadata,
            )
        except grpc.RpcError as err:
            if transient(err):
                self._targets.after_failure(address, err)  # the next call goes to the leader
            raise
        return self._matches(r)

    @staticmethod
    def _match_request(
        model_fingerprint: str, tokens: Sequence[int], cache_salt: str | None
    ) -> pb.MatchPrefixRequest:
        return pb.MatchPrefixRequest(
            model_fingerprint=model_fingerprint, tokens=tokens, cache_salt=cache_salt
        )

    @staticmethod
    def _matches(r: pb.MatchPrefixResponse) -> list[PrefixMatch]:
        return [match_from_proto(m) for m in r.matches]

    def list_pools(self, model_fingerprint: str = "") -> list[PoolInfo]:
        """Every live pool (of `model_fingerprint`, when given), by pool id."""
        r = self._call("ListPools", pb.ListPoolsRequest(model_fingerprint=model_fingerprint))
        return [pool_info_from_proto(p) for p in r.pools]

    def watch_events(
        self,
        from_sequence: int = 0,
        timeout_s: float | None = None,
        kinds: Sequence[int] = (),
        snapshot: bool = False,
        packed: bool = False,
    ) -> Iterator[pb.KvEvent]:
        """KV events from `from_sequence` (0 = from now), only of `kinds` if
        given (KvEventKind values). A KV_EVENT_KIND_RESYNC_REQUIRED event says
        events were missed; the stream goes on after it. `snapshot`: first
        every pool's cached blocks (POOL_CACHED, sequence 0), then
        KV_EVENT_KIND_SNAPSHOT_END, then the events from now. `packed`: runs
        of one pool's block events as single BLOCKS_CHANGED events."""
        address = self._targets.current
        call = self._call.stub.WatchEvents(
            pb.WatchEventsRequest(
                from_sequence=from_sequence, kinds=kinds, snapshot=snapshot, packed=packed
            ),
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
    moves the router's calls on to the leader (`Targets.after_failure`)
    before it reaches the caller, who opens the stream again."""

    def __init__(self, call, targets: Targets, address: str) -> None:
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
