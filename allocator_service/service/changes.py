"""How every change to the pools is authorized, journaled and applied in one
order, and the locks that keep one pool's work from delaying another's.

Locks, always taken in this order:
1. a pool's own lock (`PoolEntry.lock`): every read of that pool and the
   application of its records;
2. the mutation lock (`Changes.lock`): the one order of records that replay
   reproduces. Under it: the journal write (Redis: before memory changes), the
   record's index and event batch, and registrations and drops, whole. A
   Step's table work runs after it is released, under its pool's lock only,
   its events numbered in record order (`store/events.py`); except that steps
   of pools using the shared KV store, which change its one index, are
   applied whole under it, in the journal's order;
3. small leaf locks: the lease table, the event log, the stream counts.
So a long read of pool X delays only X's changes. Authentication is a dict
lookup and an HMAC, under the lease table's lock only.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from allocator_service.core.pause_points import Unpaced
from allocator_service.leases import LeaseTable
from allocator_service.store.durable import DurableState
from allocator_service.store.events import EventLog
from allocator_service.store.registry import PoolEntry, Registry
from allocator_service.wire.attest import credential_digest
from allocator_service.wire.errors import (
    BadRequest,
    PermissionDenied,
    PoolNotFound,
    Unauthenticated,
)
from allocator_service.wire.v1 import journal_pb2 as jpb

log = logging.getLogger(__name__)

# Attempts at a change whose pool was replaced by a reload of the state
# meanwhile (after a journal write whose outcome was unknown).
_ATTEMPTS = 3


class Reloaded(Exception):
    """The registry was reloaded while the call waited: start it again."""


class PoolRef(NamedTuple):
    """A pool a call names, and the credential it presents ("" for none)."""

    pool_id: str
    credential: str = ""


class Changes:
    """The order of changes: the mutation lock, the journal before memory,
    the pool a call may touch. Every part of the service changes the pools
    through here."""

    def __init__(
        self, durable: DurableState, events: EventLog, leases: LeaseTable, lock: Unpaced
    ) -> None:
        self.durable = durable
        self.events = events
        self.leases = leases
        self.lock = lock  # the mutation lock; its holder never waits for the fair share

    @property
    def registry(self) -> Registry:
        return self.durable.registry

    def authorize(self, ref: PoolRef, admin: bool = False) -> PoolEntry:
        """The pool `ref` names, if it presents that pool's credential. An
        admin needs none, and its calls do not renew the pool's lease. No
        lock: a dict lookup, an HMAC and the lease table's own lock."""
        if not ref.pool_id:
            raise BadRequest("pool.pool_id is required")
        entry = self.registry.pools.get(ref.pool_id)
        if entry is None:
            raise PoolNotFound(ref.pool_id)
        if admin:
            return entry
        if not ref.credential:
            raise Unauthenticated("this call needs the pool's credential (pool.credential)")
        if not hmac.compare_digest(credential_digest(ref.credential), entry.credential_digest):
            raise PermissionDenied(f"the credential is not that of pool {ref.pool_id!r}")
        # Any authenticated call on the pool proves its worker is alive.
        self.leases.renew(entry.pool_id)
        return entry

    def live(self, entry: PoolEntry) -> Registry:
        """Under the mutation lock: the registry (reloaded first if needed),
        in which `entry` must still be its pool. PoolNotFound if the pool was
        dropped meanwhile; Reloaded if a reload replaced it."""
        reg = self.durable.fresh()
        current = reg.pools.get(entry.pool_id)
        if current is entry:
            return reg
        if current is not None:
            raise Reloaded
        raise PoolNotFound(entry.pool_id)

    @staticmethod
    def retrying(fn: Callable[[], Any]) -> Any:
        """`fn()`, again while a reload replaced its pool (`Reloaded`)."""
        for _ in range(_ATTEMPTS - 1):
            try:
                return fn()
            except Reloaded:
                continue
        return fn()

    def apply(
        self,
        entry: PoolEntry,
        work: Callable[[Registry, Any], Any],
        shared: bool = False,
        **change: Any,
    ) -> Any:
        """Journal `change` to `entry`'s pool and apply it: its place in the
        order under the mutation lock, then `work(registry, batch)` under the
        pool's lock only (the caller holds it); `shared`: the change touches
        the shared store, and `work` runs under the mutation lock too.
        Returns what `work` returns."""
        with self.lock:
            reg = self.live(entry)
            self.durable.append(**change)
            batch = reg.advance()
            index = reg.index
            if shared:
                try:
                    self.durable.settle(entry, index)
                    self.durable.settle_store()
                    result = work(reg, batch)
                finally:
                    self.events.finish(batch)
                self.durable.changed()
                return result
            self.durable.begin_apply()
            try:
                self.durable.changed()
            except BaseException:
                self.events.finish(batch)
                self.durable.end_apply()
                raise
        try:
            self.durable.settle(entry, index)
            return work(reg, batch)
        finally:
            self.events.finish(batch)
            self.durable.end_apply()

    def drop(self, pool_id: str, reason: str) -> None:
        """Journal and apply a drop (the pool's lock and the mutation lock held)."""
        self.durable.append(dropped=jpb.PoolDropped(pool_id=pool_id, reason=reason))
        reg = self.registry
        if reg.uses_store(reg.pools[pool_id]):
            self.durable.settle_store()  # dropping it drops its pending store saves
        batch = reg.advance()
        try:
            reg.drop(pool_id, reason, batch)
        finally:
            self.events.finish(batch)
        self.leases.forget(pool_id)
        self.durable.changed()
        log.info("dropped pool %s (%s)", pool_id, reason)
