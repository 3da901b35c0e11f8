"""The allocator service as a transport-free object: credentials, the
journal write before each change, leases, and the locks that keep one
pool's work from delaying another's.

Locks, always taken in this order:

1. a pool's own lock (`PoolEntry.lock`): every read of that pool
   (GetBlockTable, GetPoolStats with its integrity check, DumpPool, its part
   of MatchPrefix, the metrics view) and the application of its records;
2. the mutation lock (`_lock`): the one global order of records. The
   journal and the KV event numbers are a single order that replay must
   reproduce exactly, so every change takes its place here: the journal
   write (Redis: before anything changes in memory) and the record's index
   and event batch; registrations and drops are applied here whole, as they
   touch no pool's blocks. A Step's table work then runs after this lock is
   released, under its pool's lock only, and its events are numbered in
   record order whenever it finishes (`store/events.py`);
3. small leaf locks: the lease table, the event log, the watcher count.

So a long read of pool X delays only X's own changes, and the mutation lock
is held for a journal write and some bookkeeping, never for a pool's
blocks, with one exception: the steps of pools that use the shared KV store
(`--kv-shared-store`) change its one index, so they are applied whole under
the mutation lock, in the journal's order, which replay then reproduces. Conversion, validation and the digest of a request run before any
lock; heartbeats and every call's lease renewal authenticate against the
registry with a dict lookup and an HMAC and take only the lease table's
lock. Cross-pool reads (MatchPrefix, metrics) visit the pools one at a time,
each under its own lock: MatchPrefix hashes the prompt once per root,
outside any lock. The durable side (load, journal, snapshots off the hot
path, the store watch and health) is `store/durable.py`.

No lease expires because the allocator was not running: the reaper measures
how late it woke (a pause, SIGSTOP, a stalled interpreter) and extends every
lease by that much, and a pool is dropped for its lease only after the
reaper holds that pool's lock and the mutation lock and finds the lease
still expired.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import compress
from typing import Any, NamedTuple

from allocator_service.config import Limits, ServiceConfig
from allocator_service.core import PoolStats, StepColumns, snapshot
from allocator_service.core.errors import InvalidArgument, UnknownSequence
from allocator_service.core.hashing import prompt_chain
from allocator_service.core.limits import MAX_ADVERTISE_URL_LEN, MAX_SERVED_MODEL_NAME_LEN
from allocator_service.core.pacing import Unpaced
from allocator_service.core.step import ADMIT, FORK, FREE, KINDS, UNRESERVE
from allocator_service.core.validation import check_cache_salt, check_tokens
from allocator_service.leases import LeaseTable
from allocator_service.sharing import CallSlots, FairShare
from allocator_service.store.durable import DurableState
from allocator_service.store.events import EventLog
from allocator_service.store.journal import MemoryJournal, RedisJournal, StepRecord
from allocator_service.store.registry import PoolEntry, Registry, new_pool
from allocator_service.wire.attest import attest_key, credential_digest
from allocator_service.wire.bounds import (
    DUMP_FRAME_BYTES,
    dump_floor,
    step_answer_bound,
    tier_bound,
)
from allocator_service.wire.codec import (
    PREV_STEP_ID_REQUIRED,
    PoolInfo,
    canonical_ops,
    columns_from_proto,
    config_from_proto,
    digest_of,
    shape_to_proto,
    stats_to_proto,
)
from allocator_service.wire.errors import (
    AnswerTooLarge,
    BadRequest,
    CapacityExceeded,
    PermissionDenied,
    PoolInUse,
    PoolNotFound,
    PoolStateLost,
    QuotaExceeded,
    ShuttingDown,
    StepConflict,
    StepStreamsExhausted,
    StoreUnavailable,
    Unauthenticated,
)
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import journal_pb2 as jpb

log = logging.getLogger(__name__)

# Attempts at a change whose pool was replaced by a reload of the state
# meanwhile (after a journal write whose outcome was unknown).
_ATTEMPTS = 3


class _Reloaded(Exception):
    """The registry was reloaded while the call waited: start it again."""


class Registration(NamedTuple):
    pool_id: str
    epoch: int
    credential: str
    lease_ttl_s: float
    shared_store: str = ""  # the store's URL, for a pool that uses it
    store_namespace: str = ""  # where its blocks live in that store (`core.tiers.store_namespace`)


class Advertised(NamedTuple):
    """What a worker tells routers about itself when it registers its pool."""

    advertise_url: str = ""
    served_model_name: str = ""

    def check(self) -> None:
        """BadRequest unless both are within their bounds (empty = not given)."""
        url, name = self.advertise_url, self.served_model_name
        if url and (len(url) > MAX_ADVERTISE_URL_LEN or not url.isprintable() or " " in url
                    or not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0):
            raise BadRequest(f"advertise_url must be an http:// or https:// URL of at most "
                             f"{MAX_ADVERTISE_URL_LEN} printable characters without spaces")
        if len(name) > MAX_SERVED_MODEL_NAME_LEN or not name.isprintable():
            raise BadRequest(f"served_model_name must be at most {MAX_SERVED_MODEL_NAME_LEN} printable characters")


NOT_ADVERTISED = Advertised()


class TierView(NamedTuple):
    """One pool's KV tiers as ListPools and the metrics read them."""

    host_blocks: int  # host tier slots (0: none)
    host_used_blocks: int  # holding an entry, pending or present
    use_shared_store: bool
    store_used_bytes: int  # the shared store's, every pool's entries
    block_bytes: int
    counters: dict[str, int]  # `core.tiers.TIER_COUNTERS`


NO_TIERS = TierView(0, 0, False, 0, 0, {})


_KINDS = frozenset(KINDS)
_TOKENLESS = frozenset((FREE, FORK, UNRESERVE))


def check_step(step: StepColumns, limits: Limits) -> None:
    """Refuse (BadRequest) columns that exceed the limits or do not fit
    together, before anything is applied. Per-operation validity (sequence
    ids, tokens, salts, num_new_tokens) is the core's business: a per-op result."""
    kinds, counts = step.kinds, step.num_tokens
    n = len(kinds)
    if n > limits.max_ops_per_step:
        raise BadRequest(f"{n} operations in one step; the limit is {limits.max_ops_per_step}")
    if len(step.seq_ids) != n or len(counts) != n:
        raise BadRequest("kinds, seq_ids and num_tokens must have one entry per operation")
    if len(step.tokens) > limits.max_tokens_per_call:
        raise BadRequest(f"{len(step.tokens)} tokens in one step; the limit is {limits.max_tokens_per_call}")
    if sum(counts) != len(step.tokens):
        raise BadRequest("num_tokens does not add up to the number of tokens sent")
    reserved = step.num_reserved
    if reserved:
        if len(reserved) != n:
            raise BadRequest("num_reserved must be empty or have one entry per operation")
        if any(r for k, r in zip(kinds, reserved, strict=True) if k == FREE or k == FORK):
            raise BadRequest("num_reserved is for APPEND, ADMIT and UNRESERVE operations only")
        taken = sum(reserved)  # slots APPENDs and ADMITs take (at C speed: this runs on every async step)
        if UNRESERVE in kinds:
            taken -= sum(compress(reserved, map(UNRESERVE.__eq__, kinds)))
        if taken + len(step.tokens) > limits.max_tokens_per_call:
            raise BadRequest(f"{taken} reserved slots and {len(step.tokens)} tokens in one step; "
                             f"the limit is {limits.max_tokens_per_call}")
    if not set(kinds) <= _KINDS:
        raise BadRequest("an operation kind is not FREE, APPEND, ADMIT, FORK or UNRESERVE")
    if kinds.count(ADMIT) != len(step.salts):
        raise BadRequest("admit_options must have one entry per ADMIT operation")
    if kinds.count(FORK) != len(step.children):
        raise BadRequest("fork_children must have one entry per FORK operation")
    # NOTE: compress/map rather than a generator: C speed over every operation.
    if (FREE in kinds or FORK in kinds or UNRESERVE in kinds) and any(
            compress(counts, map(_TOKENLESS.__contains__, kinds))):
        raise BadRequest("FREE, FORK and UNRESERVE operations carry no tokens")


def _periodic(stop: threading.Event, interval: float, fn: Callable[[], Any], name: str) -> threading.Thread:
    """A daemon thread calling `fn` every `interval` until `stop`; an
    exception is logged and the next round comes (a bug must not stop it)."""

    def loop() -> None:
        while not stop.wait(interval):
            try:
                fn()
            except Exception:
                log.exception("%s", name)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


class AllocatorService:
    def __init__(
        self,
        config: ServiceConfig | None = None,
        journal: MemoryJournal | RedisJournal | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or ServiceConfig()
        self.limits = self.config.limits
        self.journal = journal if journal is not None else MemoryJournal()
        self.events = EventLog(self.config.event_retention)
        self.leases = LeaseTable(self.config.lease_ttl_s, clock)
        # Who runs next when pools contend for the interpreter (the servicer
        # runs each call under it).
        window = self.config.fair_share_window_s
        self.fair = FairShare(window or 1.0, max_wait_s=self.config.fair_share_max_wait_s, enabled=window > 0)
        # Slow reads in flight per pool (the servicer takes a slot per call).
        self.call_slots = CallSlots(self.limits.max_calls_per_pool, self.limits.max_slow_calls)
        # The mutation lock (see the module docstring); its holder never waits
        # for the fair share (a pool waiting there would hold up every change).
        self._lock = Unpaced()
        self.durable = DurableState(self.config, self.journal, self.events, self.leases, self._lock, clock)
        self.durable.drop_pools = self.drop_pools
        self._watchers = 0
        self._step_streams: set[Callable[[], Any]] = set()  # each open StepStream's end()
        self._step_streams_ended = False
        self._watchers_lock = threading.Lock()  # the count of open streams (watchers, step streams)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clock = clock
        self.lease_extensions = 0  # times the reaper found the allocator had not run
        with self._lock:
            self.durable.load(take_ownership=True)
            self._configure_store()
        self.durable.after_change()

    @property
    def registry(self) -> Registry:
        return self.durable.registry

    @property
    def healthy(self) -> tuple[bool, str]:
        """(serving, why not)."""
        return self.durable.healthy

    @property
    def snapshot_failures(self) -> int:
        return self.durable.snapshot_failures

    def add_health_listener(self, listener: Callable[[bool, str], None]) -> None:
        """`listener(serving, reason)` now and at every change."""
        self.durable.add_health_listener(listener)

    def check_store(self) -> None:
        self.durable.check_store()

    def _configure_store(self) -> None:
        """At start (mutation lock held): the shared store of the config,
        journaled when it differs from the one recorded (`StoreConfigured`);
        the pools that used that one are dropped first (`store_changed`:
        their workers re-register and learn the new store)."""
        url, size = self.config.shared_store, self.config.shared_store_bytes
        reg = self.registry
        if reg.store_url == url and (reg.store.capacity_bytes if reg.store is not None else 0) == size:
            return
        for e in [e for e in reg.pools.values() if reg.uses_store(e)]:
            self._drop(e.pool_id, "store_changed")
        self.durable.append(store=jpb.StoreConfigured(url=url, capacity_bytes=size))
        batch = reg.advance()
        try:
            reg.configure_store(url, size)
        finally:
            self.events.finish(batch)
        self.durable.changed()
        if url:
            log.info("shared KV store %s, %d bytes", url, size)

    # ----------------------------------------------------------- lifecycle
    def reaper_interval(self) -> float:
        return min(max(self.config.lease_ttl_s / 4, 0.05), 1.0)

    def start(self) -> None:
        """Start the lease reaper, and with a durable journal the store watch
        and the snapshot thread."""
        interval = self.reaper_interval()
        last = [self._clock()]

        def reap() -> None:
            now = self._clock()
            self.extend_if_late(now - last[0] - interval)
            self.expire_leases()
            last[0] = self._clock()

        self._threads.append(_periodic(self._stop, interval, reap, "lease-reaper"))
        if self.journal.durable:  # health follows the state store
            self._threads.append(_periodic(self._stop, self.durable.store_check_s, self.check_store, "store-watch"))
            self.durable.background = True
            thread = threading.Thread(target=self.durable.snapshot_loop, args=(self._stop,),
                                      name="snapshot", daemon=True)
            thread.start()
            self._threads.append(thread)

    def extend_if_late(self, late: float) -> None:
        """The reaper woke `late` seconds after it should have: the process
        did not run (paused, stopped, starved), so no worker could renew its
        lease meanwhile; every lease gets that time back."""
        if late > self.reaper_interval() / 2:
            self.leases.extend(late)
            self.lease_extensions += 1
            log.warning("the allocator did not run for %.2f s (paused or stalled): every lease "
                        "extended by that much", late)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.events.close()
        self.journal.close()

    def authorize(self, ref: pb.PoolRef) -> None:
        """Raise unless `ref` presents its pool's credential (the servicer
        checks it before a call takes one of that pool's slots)."""
        self._authorize(ref)

    # ------------------------------------------------------------ internals
    def _authorize(self, ref: pb.PoolRef, admin: bool = False) -> PoolEntry:
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

    def _live(self, entry: PoolEntry) -> Registry:
        """Under the mutation lock: the registry (reloaded first if needed),
        in which `entry` must still be its pool. PoolNotFound if the pool was
        dropped meanwhile; _Reloaded if a reload replaced it."""
        reg = self.durable.fresh()
        current = reg.pools.get(entry.pool_id)
        if current is entry:
            return reg
        if current is not None:
            raise _Reloaded
        raise PoolNotFound(entry.pool_id)

    def _retrying(self, fn: Callable[[], Any]) -> Any:
        for _ in range(_ATTEMPTS - 1):
            try:
                return fn()
            except _Reloaded:
                continue
        return fn()

    def _apply(self, entry: PoolEntry, work: Callable[[Registry, Any], Any], shared: bool = False,
               **change: Any) -> Any:
        """Journal `change` to `entry`'s pool and apply it: its place in the
        order under the mutation lock, then `work(registry, batch)` under the
        pool's lock only (the caller holds it); `shared`: the change touches
        the shared store, and `work` runs under the mutation lock too.
        Returns what `work` returns."""
        with self._lock:
            reg = self._live(entry)
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

    # ------------------------------------------------------------ pool calls
    def register(self, worker_id: str, shape: pb.PoolShape, replace_credential: str = "",
                 advertised: Advertised = NOT_ADVERTISED, protocol_version: int = 0) -> Registration:
        """A new pool for `worker_id`. A live pool of the same worker id is
        replaced only with its credential; else PoolInUse until its lease
        expires (so nobody can drop another worker's pool by naming it).
        `advertised`: its HTTP URL and served model name, for routers;
        `protocol_version`: the client's (from `PREV_STEP_ID_REQUIRED` on,
        each Step of the pool must carry prev_step_id)."""
        limit = self.limits.max_worker_id_len
        if not worker_id or len(worker_id) > limit or "/" in worker_id or not worker_id.isprintable():
            raise BadRequest(f"worker_id must be 1 to {limit} printable characters without '/'")
        advertised.check()
        if shape.store_group:
            raise BadRequest("store_group is the allocator's to set, from the worker's credential "
                             "(its group= in --worker-tokens-file)")
        config = config_from_proto(shape)
        if config.use_shared_store and self.registry.store is None:
            # no store here: the pool is registered (and journaled) without it
            config = replace(config, use_shared_store=False)
        elif config.use_shared_store:
            # its trust domain in the store, journaled with the pool (replays never ask the policy again)
            config = replace(config, store_group=self.config.store_groups.get(worker_id, ""))
        shape = shape_to_proto(config)
        self._check_quota(worker_id, config.num_blocks)  # before the pool is built: a refused one costs nothing
        credential = secrets.token_urlsafe(32)
        digest = credential_digest(credential)
        fresh = new_pool(config, self.registry.store)  # O(blocks): before any lock

        def attempt() -> PoolEntry:
            reg = self.registry
            old = reg.pools.get(reg.current.get(worker_id, ""))
            with old.lock if old is not None else contextlib.nullcontext():
                with self._lock:
                    reg = self.durable.fresh()
                    if reg.pools.get(reg.current.get(worker_id, "")) is not old:
                        raise _Reloaded  # replaced or reloaded while we waited
                    return self._register(reg, worker_id, shape, config, digest, old, replace_credential,
                                          fresh, advertised, protocol_version)

        entry = self._retrying(attempt)
        self.durable.after_change()
        log.info("registered pool %s (%d blocks of %d)", entry.pool_id, config.num_blocks, config.block_size)
        return Registration(entry.pool_id, entry.epoch, credential, self.config.lease_ttl_s,
                            self.registry.store_url if config.use_shared_store else "", config.store_namespace)

    def _register(self, reg: Registry, worker_id: str, shape: pb.PoolShape, config, digest: bytes,
                  old: PoolEntry | None, replace_credential: str, fresh,
                  advertised: Advertised = NOT_ADVERTISED, protocol_version: int = 0) -> PoolEntry:
        if old is not None:
            self._check_replace(old, replace_credential)
        if config.use_shared_store and fresh[0].tiers.store is not reg.store:
            fresh = new_pool(config, reg.store)  # the registry was reloaded meanwhile: its store
        pools = len(reg.pools) - (old is not None)
        if pools >= self.limits.max_pools:
            raise CapacityExceeded(f"the server holds its maximum of {self.limits.max_pools} pools")
        blocks = sum(e.pool.num_blocks for e in reg.pools.values()) - (old.pool.num_blocks if old else 0)
        held = {e.worker_id: e.pool.num_blocks for e in reg.pools.values()}
        # What the other workers' quotas keep for them beyond what they hold now (a restart included).
        kept = sum(max(q - held.get(w, 0), 0) for w, q in self.config.reserved_blocks.items() if w != worker_id)
        if blocks + kept + config.num_blocks > self.limits.max_total_blocks:
            raise CapacityExceeded(
                f"{config.num_blocks} more blocks would exceed the server's "
                f"{self.limits.max_total_blocks} (in use: {blocks}"
                + (f"; kept for other workers' quotas: {kept}" if kept else "") + ")"
            )
        epoch = reg.next_epoch(worker_id)
        self.durable.append(
            registered=jpb.PoolRegistered(
                pool_id=f"{worker_id}/{epoch}",
                worker_id=worker_id,
                epoch=epoch,
                shape=shape,
                credential_digest=digest,
                advertise_url=advertised.advertise_url,
                served_model_name=advertised.served_model_name,
                protocol_version=protocol_version,
            )
        )
        if old is not None and reg.uses_store(old):
            self.durable.settle_store()  # dropping it drops its pending store saves
        batch = reg.advance()
        try:
            entry = reg.register(worker_id, epoch, config, digest, batch, fresh, **advertised._asdict(),
                                 protocol_version=protocol_version)
        finally:
            self.events.finish(batch)
        if old is not None:
            self.leases.forget(old.pool_id)
        self.leases.arm(entry.pool_id)
        self.durable.changed()
        return entry

    def _check_quota(self, worker_id: str, num_blocks: int) -> None:
        """QuotaExceeded past the worker's quota, or for a worker without
        one past `max_pool_blocks`."""
        quota = self.config.reserved_blocks.get(worker_id)
        if quota is not None and num_blocks > quota:
            raise QuotaExceeded(f"worker {worker_id!r} may register at most {quota} blocks (its quota in "
                                f"--worker-tokens-file), not {num_blocks}")
        if quota is None and self.config.max_pool_blocks is not None and num_blocks > self.config.max_pool_blocks:
            raise QuotaExceeded(f"a pool may have at most {self.config.max_pool_blocks} blocks "
                                f"(--max-pool-blocks), not {num_blocks}")

    def _check_replace(self, old: PoolEntry, credential: str) -> None:
        if not credential:
            raise PoolInUse(
                f"worker id {old.worker_id!r} has a live pool {old.pool_id} (its lease expires in "
                f"{self.leases.remaining(old.pool_id):.1f} s unless renewed): present its credential "
                "as replace_credential to replace it, or wait for the lease to expire"
            )
        if not hmac.compare_digest(credential_digest(credential), old.credential_digest):
            raise PermissionDenied(f"replace_credential is not the credential of pool {old.pool_id!r}")

    def heartbeat(self, ref: pb.PoolRef) -> float:
        self._authorize(ref)  # renews: no pool's lock, no mutation lock
        return self.config.lease_ttl_s

    def deregister(self, ref: pb.PoolRef) -> None:
        def attempt() -> None:
            entry = self._authorize(ref)
            with entry.lock, self._lock:
                self._live(entry)
                self._drop(entry.pool_id, "deregistered")

        self._retrying(attempt)
        self.durable.after_change()

    def _drop(self, pool_id: str, reason: str) -> None:
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

    def step(self, ref: pb.PoolRef, step_id: int, ops_msg: pb.StepOps,
             prev_step_id: int | None = None) -> pb.StepResponse:
        if step_id < 1:
            raise BadRequest("step_id must be positive")
        # Converting, validation and hashing need no lock.
        step = columns_from_proto(ops_msg)
        check_step(step, self.limits)
        # Encoded once: the digest covers these bytes, the journal stores them.
        ops_bytes = canonical_ops(ops_msg)
        digest = digest_of(ops_bytes)

        def attempt() -> pb.StepResponse:
            entry = self._authorize(ref)
            if prev_step_id is None and entry.protocol_version >= PREV_STEP_ID_REQUIRED:
                raise BadRequest(f"pool {entry.pool_id} was registered with protocol_version "
                                 f"{entry.protocol_version}: every Step must carry prev_step_id")
            with entry.lock:
                if step_id <= entry.last_step_id:
                    if step_id == entry.last_step_id and digest == entry.last_digest:
                        return entry.last_response  # a retry: same answer, applied once
                    if step_id == entry.last_step_id:
                        raise StepConflict(f"step {step_id} was already applied with other operations")
                    raise StepConflict(f"step {step_id} is older than the pool's last step {entry.last_step_id}")
                if prev_step_id is not None and prev_step_id != entry.last_step_id:
                    self._state_lost(entry, prev_step_id)
                self._check_report(entry, step)
                self._check_answer(entry, step)
                record = StepRecord(entry.pool_id, step_id, digest, ops_bytes)
                return self._apply(
                    entry, lambda reg, batch: reg.apply_step(entry, batch, step_id, digest, step),
                    shared=self.registry.uses_store(entry), step=record,
                )

        response = self._retrying(attempt)
        self.durable.after_change()
        return response

    @staticmethod
    def _check_report(entry: PoolEntry, step: StepColumns) -> None:
        """Refuse (BadRequest) a tier report naming what the pool could not
        have issued, before it is journaled (the pool's lock held)."""
        report = step.report
        if not any(report):
            return
        try:
            entry.pool.check_report(*report)
        except InvalidArgument as exc:
            raise BadRequest(str(exc)) from None

    def _check_answer(self, entry: PoolEntry, step: StepColumns) -> None:
        """Refuse (AnswerTooLarge) a step whose answer could be larger than
        the wire carries, before it is journaled: a refused call changes
        nothing (the pool's lock held)."""
        pool = entry.pool

        def held(seq_id: str) -> int | None:
            try:
                return pool.num_tokens(seq_id)
            except UnknownSequence:
                return None

        tiers = None
        if pool.tiers is not None:
            store = pool.tiers.store
            tiers = tier_bound(store.capacity_bytes if store is not None else 0, self.registry.store_min_bytes,
                               pool.config.block_bytes)
        bound = step_answer_bound(step, pool.num_blocks, pool.block_size, held, tiers)
        if bound > self.limits.max_message_bytes:
            raise AnswerTooLarge(
                f"the answer to these {len(step.kinds)} operations could take up to {bound} bytes, more than the "
                f"{self.limits.max_message_bytes} a message may; nothing was applied: send them in smaller steps")

    def _state_lost(self, entry: PoolEntry, prev_step_id: int) -> None:
        """The worker got an answer for a step this server does not have (its
        journal lost records): drop the pool before it hands out a block the
        worker still uses; NOT_FOUND makes the worker re-register and recompute."""
        message = (
            f"pool {entry.pool_id} was dropped: its worker follows step {prev_step_id} but the "
            f"allocator's last step for it is {entry.last_step_id} (the allocator's state lost records)"
        )
        with self._lock:
            self._live(entry)
            log.error("%s", message)
            self._drop(entry.pool_id, "state_lost")
        raise PoolStateLost(entry.pool_id, message)

    def block_table(self, ref: pb.PoolRef, seq_id: str) -> tuple[list[int], int]:
        entry = self._authorize(ref)
        with entry.lock:
            return entry.pool.block_table(seq_id), entry.pool.num_tokens(seq_id)

    def stats(self, ref: pb.PoolRef, check_integrity: bool = False, admin: bool = False) -> pb.GetPoolStatsResponse:
        entry = self._authorize(ref, admin)
        with entry.lock:
            problems = entry.pool.integrity_problems() if check_integrity else []
            stats, last = entry.pool.stats(), entry.last_step_id
        return stats_to_proto(stats, last_step_id=last, integrity_problems=problems,
                              integrity_checked=check_integrity)

    def reset_prefix_cache(self, ref: pb.PoolRef, admin: bool = False) -> int:
        def attempt() -> int:
            entry = self._authorize(ref, admin)
            with entry.lock:
                return self._apply(entry, lambda reg, batch: reg.apply_reset(entry, batch),
                                   reset=jpb.PrefixCacheReset(pool_id=entry.pool_id))

        dropped = self._retrying(attempt)
        self.durable.after_change()
        return dropped

    def dump(self, ref: pb.PoolRef, admin: bool = False) -> tuple[str, int, list[str]]:
        """The pool's full dump as JSON text, its last step id and its
        integrity problems. A dump larger than an answer may be is refused
        (AnswerTooLarge); one that certainly is (`dump_floor`,
        counted under the lock) is refused before it is built."""
        entry = self._authorize(ref, admin)
        limit = self.limits.max_message_bytes
        with entry.lock:
            floor = dump_floor(entry.pool)
            if floor > limit:
                raise AnswerTooLarge(self._dump_refusal(ref, floor, limit, "at least "))
            state, last_step_id, problems = entry.pool.to_state(), entry.last_step_id, entry.pool.integrity_problems()
        text = snapshot.dumps_chunked(state)  # outside the lock: the pool's steps go on
        if len(text) + DUMP_FRAME_BYTES > limit:
            raise AnswerTooLarge(self._dump_refusal(ref, len(text), limit, ""))
        return text, last_step_id, problems

    @staticmethod
    def _dump_refusal(ref: pb.PoolRef, size: int, limit: int, how: str) -> str:
        return (f"pool {ref.pool_id}'s dump takes {how}{size:,} bytes, more than the {limit:,} an answer may: "
                f"read its block tables with GetBlockTable, or its stats and integrity with GetPoolStats")

    # ------------------------------------------------------- cross-pool calls
    def match_prefix(self, fingerprint: str, tokens: list[int], salt: str | None) -> list[pb.PrefixMatch]:
        """Which pools hold how much of the prompt. The prompt's hash chain is
        computed once per block size, outside any lock; each pool is then
        visited under its own lock for lookups only."""
        if len(tokens) > self.limits.max_tokens_per_call:
            raise BadRequest(f"{len(tokens)} tokens; the limit is {self.limits.max_tokens_per_call}")
        check_cache_salt(salt)
        pools = [e for e in list(self.registry.pools.values()) if e.pool.config.model_fingerprint == fingerprint]
        if len(tokens) >= 2 and any(e.pool.enable_prefix_caching for e in pools):
            check_tokens(tokens)
        chains: dict[int, list[bytes]] = {}
        out = []
        for e in pools:
            pool = e.pool
            cached = host = store = 0
            if pool.enable_prefix_caching and len(tokens) >= 2:
                size = pool.block_size
                hashes = chains.get(size)
                if hashes is None:
                    hashes = chains[size] = prompt_chain(fingerprint, tokens, size, salt)
                # NOTE: the store's index is read without the mutation lock
                # (lookups only): a figure as of some moment of this call.
                with e.lock:
                    cached, host, store = pool.tier_blocks(hashes)
                cached, host, store = cached * size, host * size, store * size
            out.append(
                pb.PrefixMatch(
                    pool_id=e.pool_id,
                    worker_id=e.worker_id,
                    cached_tokens=cached,
                    free_blocks=pool.num_free_blocks,
                    block_size=pool.block_size,
                    host_tokens=host,
                    store_tokens=store,
                )
            )
        out.sort(key=lambda m: (-m.cached_tokens, -m.free_blocks, m.pool_id))
        return out

    def expire_leases(self) -> list[str]:
        """Drop every pool whose lease ran out (the reaper calls this). Each
        drop takes the locks as a change does (the pool's, then the mutation
        lock), so waiting for a busy pool holds up no other pool."""
        dropped: list[str] = []
        for pool_id in self.leases.expired():
            entry = self.registry.pools.get(pool_id)
            if entry is None:
                self.leases.forget(pool_id)
                continue
            try:
                with entry.lock, self._lock:
                    reg = self.durable.fresh()
                    if reg.pools.get(pool_id) is not entry:
                        continue  # dropped or reloaded meanwhile: the next round looks again
                    if not self.leases.is_expired(pool_id):
                        continue  # renewed while we waited for the pool
                    self._drop(pool_id, "lease_expired")
            except StoreUnavailable as exc:
                log.warning("lease of %s expired but the drop cannot be journaled: %s", pool_id, exc)
                break
            dropped.append(pool_id)
        if dropped:
            self.durable.after_change()
        return dropped

    def drop_pools(self, pool_ids: list[str], reason: str) -> list[str]:
        """Drop these pools loudly (their workers get NOT_FOUND and register
        again), each taking the locks as a change does: the snapshot
        writer's way to keep one pool from holding up every snapshot.
        Returns the pools dropped."""
        dropped: list[str] = []
        for pool_id in pool_ids:
            entry = self.registry.pools.get(pool_id)
            if entry is None:
                continue
            try:
                with entry.lock, self._lock:
                    if self.durable.fresh().pools.get(pool_id) is not entry:
                        continue
                    self._drop(pool_id, reason)
            except StoreUnavailable as exc:
                log.warning("pool %s is to be dropped (%s) but the drop cannot be journaled: %s",
                            pool_id, reason, exc)
                break
            dropped.append(pool_id)
        return dropped

    def list_pools(self, fingerprint: str = "") -> list[PoolInfo]:
        """Every live pool (of `fingerprint`, when given), by pool id: what a
        router needs to reach its worker and weigh its load. Each pool is
        read under its own lock."""
        out = []
        for e in sorted(list(self.registry.pools.values()), key=lambda e: e.pool_id):
            config = e.pool.config
            if fingerprint and config.model_fingerprint != fingerprint:
                continue
            with e.lock:
                s, t = e.pool.stats(), self._tier_view(e)
            out.append(PoolInfo(e.pool_id, e.worker_id, config.model_fingerprint, e.served_model_name,
                                e.advertise_url, s.block_size, s.num_blocks, s.free_blocks, s.used_blocks,
                                s.cached_blocks, s.num_sequences, e.pool.enable_prefix_caching,
                                attest_key(e.credential_digest), t.host_blocks, t.host_used_blocks,
                                t.use_shared_store, t.store_used_bytes, t.counters.get("host_hit_tokens", 0),
                                t.counters.get("store_hit_tokens", 0)))
        return out

    @staticmethod
    def _tier_view(e: PoolEntry) -> TierView:
        """A pool's tiers as the listing and the metrics read them (its lock held)."""
        tiers = e.pool.tiers
        if tiers is None:
            return NO_TIERS
        host = tiers.host
        store = tiers.store
        return TierView(host.lru.capacity if host is not None else 0, len(host.lru) if host is not None else 0,
                        store is not None, store.lru.used if store is not None else 0,
                        e.pool.config.block_bytes, dict(tiers.counters))

    def tier_stats(self) -> list[tuple[str, str, TierView]]:
        """(pool id, worker id, its tiers) of every live pool with KV tiers,
        each read under its own lock: what the metrics collector reads."""
        out = []
        for e in list(self.registry.pools.values()):
            if e.pool.tiers is not None:
                with e.lock:
                    out.append((e.pool_id, e.worker_id, self._tier_view(e)))
        return out

    def store_stats(self) -> dict[str, int] | None:
        """The shared store's figures (None: no store): capacity and used
        bytes, entries (pending ones included), entries refused at load and
        dropped for room. Read without the mutation lock: a figure."""
        store = self.registry.store
        if store is None:
            return None
        return {"capacity_bytes": store.capacity_bytes, "used_bytes": store.lru.used, "entries": len(store.lru),
                "pending": len(store.lru.pending), "refused": store.refused, "dropped": store.dropped}

    def free_blocks(self, pool_id: str) -> int | None:
        """A live pool's free blocks (None: no such pool), read without its
        lock as MatchPrefix reads them: a load figure, not a promise."""
        entry = self.registry.pools.get(pool_id)
        return entry.pool.num_free_blocks if entry is not None else None

    def cached_blocks(self, chunk: int) -> Iterator[tuple[str, list[int], list[bytes]]]:
        """(pool id, blocks, their hashes), at most `chunk` blocks each, for
        every live pool's cached blocks: the start of a WatchEvents snapshot.
        Streamed: each piece is read under the pool's lock over `chunk` block
        ids, and the lock is let go between pieces, so a watcher holds no
        copy of a whole pool and a Step waits for one piece at most. A block
        is then read as it is at some moment after this call started; every
        event numbered from before the call (a block stored or removed, the
        cache cleared), replayed onto the pieces, sets each block to what
        its last event says, so the view at their end is exactly the pool's."""
        for e in list(self.registry.pools.values()):
            hashes = e.pool.index.block_hash
            for lo in range(0, len(hashes), chunk):
                with e.lock:
                    if self.registry.pools.get(e.pool_id) is not e:
                        break  # dropped meanwhile (its POOL_DROPPED event follows)
                    part = hashes[lo:lo + chunk]
                ids = [b for b, h in enumerate(part, lo) if h is not None]
                if ids:
                    yield e.pool_id, ids, [h for h in part if h is not None]

    def pool_stats(self) -> list[tuple[str, str, PoolStats]]:
        """(pool id, worker id, stats) of every live pool, each read under its
        own lock: what the metrics collector reads."""
        out = []
        for e in list(self.registry.pools.values()):
            with e.lock:
                out.append((e.pool_id, e.worker_id, e.pool.stats()))
        return out

    # --------------------------------------------------------------- watchers
    def open_watcher(self) -> None:
        with self._watchers_lock:
            if self._watchers >= self.limits.max_watchers:
                raise CapacityExceeded(f"the server serves at most {self.limits.max_watchers} event streams")
            self._watchers += 1

    def close_watcher(self) -> None:
        with self._watchers_lock:
            self._watchers -= 1

    def open_step_stream(self, end: Callable[[], Any]) -> None:
        """Count a StepStream in (`end()` ends it: `end_step_streams`)."""
        with self._watchers_lock:
            if self._step_streams_ended:
                raise ShuttingDown("the allocator is shutting down")
            if len(self._step_streams) >= self.limits.max_step_streams:
                raise StepStreamsExhausted(
                    f"the server serves at most {self.limits.max_step_streams} step streams: send unary Steps"
                )
            self._step_streams.add(end)

    def close_step_stream(self, end: Callable[[], Any]) -> None:
        with self._watchers_lock:
            self._step_streams.discard(end)

    def end_step_streams(self) -> None:
        """At shutdown: end every open StepStream (an idle one now: it waits
        for its worker's next step and would hold the shutdown for its
        grace; a busy one once its step is answered) and refuse new ones."""
        with self._watchers_lock:
            self._step_streams_ended = True
            ends = list(self._step_streams)
        for end in ends:
            end()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()
