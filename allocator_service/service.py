"""The allocator service as a transport-free object: one lock around the
registry, the journal write before each change, leases and credentials.

Every mutating call follows the same path under the lock: check the caller,
validate, journal the record (Redis: before anything changes in memory),
apply it to the registry, then maybe snapshot. Journaling FIRST means a
failed write leaves memory untouched, so the caller can simply retry; if the
write's outcome is unknown (a timeout after Redis may have stored it), the
service marks itself stale and rebuilds from Redis before the next change,
so memory never drifts from the journal.

Health tells the truth: the service is unhealthy (`healthy`, and every
listener added with `add_health_listener`: the gRPC health status) while its
state store is unreachable, fenced by another instance, or lost what this
instance wrote. A store that lost its data is detected on the next write or
by the store watch (every `store_check_s`); then every pool is dropped
loudly (reason `state_lost`: their workers get NOT_FOUND, re-register and
recompute), the store is seeded again from a snapshot of what is left
(epochs and event numbers carry on, so no pool id is reissued), and the
service is healthy again.

One lock for all pools, not one per pool: the journal and the KV event
numbers are a single global order, which replay must reproduce exactly, and
the GIL would serialise the pure-Python work anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from allocator_service.codec import (
    columns_from_proto,
    config_from_proto,
    ops_digest,
    stats_to_proto,
)
from allocator_service.config import Limits, ServiceConfig
from allocator_service.core import PoolStats, StepColumns
from allocator_service.core.errors import InvalidArgument
from allocator_service.core.limits import MAX_SALT_LEN
from allocator_service.core.step import ADMIT, APPEND, FORK, FREE
from allocator_service.errors import (
    BadRequest,
    CapacityExceeded,
    PermissionDenied,
    PoolInUse,
    PoolNotFound,
    PoolStateLost,
    StepConflict,
    StoreFenced,
    StoreLost,
    StoreUnavailable,
    Unauthenticated,
)
from allocator_service.events import EventLog
from allocator_service.journal import MemoryJournal, RedisJournal
from allocator_service.leases import LeaseTable
from allocator_service.state import (
    ZERO_CHAIN,
    CorruptState,
    PoolEntry,
    Registry,
    encode_entry,
    encode_snapshot,
    head_marker,
    replay,
)
from allocator_service.v1 import allocator_pb2 as pb
from allocator_service.v1 import journal_pb2 as jpb

log = logging.getLogger(__name__)


class Registration(NamedTuple):
    pool_id: str
    epoch: int
    credential: str
    lease_ttl_s: float


class PoolView(NamedTuple):
    """What the metrics collector reads of one pool."""

    pool_id: str
    worker_id: str
    stats: PoolStats


def _digest(credential: str) -> bytes:
    return hashlib.sha256(credential.encode()).digest()


_KINDS = frozenset((FREE, APPEND, ADMIT, FORK))


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
    if not set(kinds) <= _KINDS:
        raise BadRequest("an operation kind is not FREE, APPEND, ADMIT or FORK")
    if kinds.count(ADMIT) != len(step.salts):
        raise BadRequest("admit_options must have one entry per ADMIT operation")
    if kinds.count(FORK) != len(step.children):
        raise BadRequest("fork_children must have one entry per FORK operation")
    if (FREE in kinds or FORK in kinds) and any(
        c for k, c in zip(kinds, counts, strict=True) if k == FREE or k == FORK
    ):
        raise BadRequest("FREE and FORK operations carry no tokens")


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


# A failed snapshot is tried again after this, doubling up to the cap.
SNAPSHOT_BACKOFF_S = 1.0
SNAPSHOT_BACKOFF_CAP_S = 60.0


class AllocatorService:
    # How often the store watch looks at the state store (durable only).
    store_check_s = 1.0

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
        self.registry = Registry(self.events)
        self._lock = threading.Lock()
        self._stale = False  # memory may lack the last journal write: reload first
        self._since_snapshot = 0
        self._watchers = 0
        self._watchers_lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self._clock = clock
        self._init_log_state()
        with self._lock:
            self._load(take_ownership=True)

    # ----------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the lease reaper thread."""
        interval = min(max(self.config.lease_ttl_s / 4, 0.05), 1.0)
        self._reaper = _periodic(self._stop, interval, self.expire_leases, "lease-reaper")
        if self.journal.durable:  # health follows the state store
            self._watch = _periodic(self._stop, self.store_check_s, self.check_store, "store-watch")

    def close(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        if self._watch is not None:
            self._watch.join(timeout=5)
        self.events.close()
        self.journal.close()

    # ------------------------------------------------------------ internals
    def _load(self, take_ownership: bool) -> None:
        """Rebuild the registry from the journal (and its snapshot), checking
        every digest and chain (`state.replay`). Damage pinned on pools drops
        them loudly and the repaired state is stored at once as a new
        snapshot; damage that cannot be pinned on a pool raises CorruptState."""
        loaded = self.journal.load(take_ownership)
        registry, report = replay(loaded.snapshot, loaded.entries, loaded.head, self.events)
        fatal = report.fatal
        if fatal is not None:
            raise CorruptState(
                f"the journal in {self.journal.describe()} is damaged at {fatal}. Inspect it with "
                "`pagedkv allocator --state URL --check`; to start over, delete the keys "
                "<prefix>journal, <prefix>snapshot and <prefix>head (every worker then re-registers "
                "and recomputes once): see docs/RELIABILITY.md, 'A log that verifies itself'"
            )
        self.registry = registry
        self._chain = report.chain
        self._head = head_marker(registry.index, self._chain) if loaded.head is not None else b""
        self.events.publish()
        self.leases.rearm(list(registry.pools))
        self._since_snapshot = len(loaded.entries)
        self._stale = False
        if report.snapshot_legacy or report.legacy_records:
            log.warning("the journal was written by an older version (%d records without digests%s): "
                        "loaded on index continuity alone; the next snapshot converts it",
                        report.legacy_records, ", an undigested snapshot" if report.snapshot_legacy else "")
        for problem in report.problems:
            log.error("journal check: %s", problem)
        if report.problems:
            log.error("journal check: %d problem(s); pools dropped: %s; storing the repaired state",
                      len(report.problems), ", ".join(report.dropped) or "none")
            self._reseed()
        if loaded.snapshot is not None or loaded.entries:
            log.info(
                "restored %d pools from %s (snapshot at record %d, %d records replayed)",
                len(registry.pools),
                self.journal.describe(),
                report.snapshot_index,
                len(loaded.entries),
            )

    def _reseed(self) -> None:
        """Store the registry as the whole new history (a snapshot, an empty
        journal, the head and the owner key)."""
        self._head = head_marker(self.registry.index, self._chain)
        self.journal.reseed(encode_snapshot(self.registry.to_snapshot(self._chain)), self._head)
        self._since_snapshot = 0

    def _fresh(self) -> Registry:
        """The registry, reloaded first if a journal write's fate is unknown."""
        if self._lost is not None:
            self._recover()
        if self._stale:
            with self._store_write():
                self._load(take_ownership=False)
        return self.registry

    @contextlib.contextmanager
    def _store_write(self):
        """Around a store call: a loss is acted on (pools dropped, store
        seeded again), fencing makes health NOT_SERVING, and any failure
        leaves memory possibly behind the store (reload before the next
        change). The error goes on to the caller (UNAVAILABLE: it retries)."""
        try:
            yield
        except StoreLost as exc:
            self._on_lost(str(exc))
            raise
        except StoreFenced as exc:
            self._set_health(False, str(exc))
            raise
        except StoreUnavailable:
            self._stale = True
            raise

    def _journal(self, **change: Any) -> None:
        if not self.journal.durable:
            return
        step = change.get("step")
        if step is not None:  # each pool's steps form a chain replay checks
            step.prev_step_id = self.registry.pools[step.pool_id].last_step_id
        index = self.registry.index + 1
        record = jpb.JournalRecord(index=index, **change)
        entry, chain = encode_entry(self._chain, record.SerializeToString())
        head = head_marker(index, chain)
        with self._store_write():
            self.journal.append(entry, self._head, head)
        self._chain, self._head = chain, head

    def _changed(self) -> None:
        self.events.publish()
        if self.journal.durable:
            self._since_snapshot += 1
            if self._since_snapshot >= self.config.snapshot_every and self._clock() >= self._snapshot_not_before:
                self._snapshot()

    def _snapshot(self) -> None:
        blob = encode_snapshot(self.registry.to_snapshot(self._chain))
        try:
            self.journal.write_snapshot(blob, self._head)
        except StoreLost as exc:
            self._on_lost(str(exc))
            return
        except StoreUnavailable as exc:
            # Harmless: the journal still holds every record. Back off
            # (doubling, capped) instead of retrying on every change.
            self.snapshot_failures += 1
            delay = min(SNAPSHOT_BACKOFF_S * 2 ** (self._snapshot_streak), SNAPSHOT_BACKOFF_CAP_S)
            self._snapshot_streak += 1
            self._snapshot_not_before = self._clock() + delay
            log.warning("snapshot not written (next try in %.1f s at the earliest): %s", delay, exc)
            return
        self._since_snapshot = 0
        self._snapshot_streak = 0
        self._snapshot_not_before = 0.0

    # ---------------------------------------------------- the store's health
    def _init_log_state(self) -> None:
        self._chain = ZERO_CHAIN  # chain digest of the last record written
        self._head = b""  # the head marker that record set in the store
        self._lost: str | None = None  # the store lost our state: recover before serving
        self._health: tuple[bool, str] = (True, "")
        self._health_listeners: list[Callable[[bool, str], None]] = []
        self._watch: threading.Thread | None = None
        self.snapshot_failures = 0
        self._snapshot_streak = 0
        self._snapshot_not_before = 0.0

    @property
    def healthy(self) -> tuple[bool, str]:
        """(serving, why not)."""
        return self._health

    def add_health_listener(self, listener: Callable[[bool, str], None]) -> None:
        """`listener(serving, reason)` now and at every change."""
        self._health_listeners.append(listener)
        listener(*self._health)

    def _set_health(self, serving: bool, reason: str) -> None:
        if self._health[0] == serving and (serving or self._health[1] == reason):
            return
        self._health = (serving, reason)
        if serving:
            log.warning("health: SERVING again (the state store is usable)")
        else:
            log.error("health: NOT_SERVING: %s", reason)
        for listener in self._health_listeners:
            try:
                listener(serving, reason)
            except Exception:  # a listener must not break the service
                log.exception("health listener")

    def _on_lost(self, reason: str) -> None:
        """The store lost what we wrote: every pool is dropped (their history
        is no longer durable), then the store is seeded again."""
        self._set_health(False, f"the state store lost the allocator's state: {reason}")
        if self._lost is None:
            self._lost = reason
            pools = list(self.registry.pools)
            log.error("the state store lost the allocator's state (%s); dropping all %d pools: %s",
                      reason, len(pools), ", ".join(pools) or "none")
            for pool_id in pools:
                self.registry.drop(pool_id, "state_lost")
                self.leases.forget(pool_id)
            self.events.publish()
            self._stale = False
        try:
            self._recover()
        except StoreUnavailable as exc:
            log.warning("the state store cannot be seeded again yet: %s", exc)

    def _recover(self) -> None:
        """Seed the store from memory after a loss (raises while it cannot)."""
        try:
            self._reseed()
        except StoreFenced as exc:
            self._set_health(False, str(exc))
            raise
        log.warning("the state store holds a fresh history from record %d; workers re-register",
                    self.registry.index)
        self._lost = None
        self._set_health(True, "")

    def check_store(self) -> None:
        """One look at the state store (the store watch calls this): health
        follows what it finds, and a loss is acted on."""
        if not self.journal.durable:
            return
        with self._lock:
            try:
                if self._lost is not None or self._stale:
                    self._fresh()
                else:
                    with self._store_write():
                        self.journal.probe(self._head)
            except (StoreLost, StoreFenced):
                return  # acted on, health set, by _store_write
            except StoreUnavailable as exc:
                self._set_health(False, f"the state store is unreachable: {exc}")
                return
            self._set_health(True, "")

    def _authorize(self, ref: pb.PoolRef, admin: bool = False) -> PoolEntry:
        """The pool `ref` names, if it presents that pool's credential. An
        admin needs none, and its calls do not renew the pool's lease."""
        if not ref.pool_id:
            raise BadRequest("pool.pool_id is required")
        entry = self.registry.pools.get(ref.pool_id)
        if entry is None:
            raise PoolNotFound(ref.pool_id)
        if admin:
            return entry
        if not ref.credential:
            raise Unauthenticated("this call needs the pool's credential (pool.credential)")
        if not hmac.compare_digest(_digest(ref.credential), entry.credential_digest):
            raise PermissionDenied(f"the credential is not that of pool {ref.pool_id!r}")
        # Any authenticated call on the pool proves its worker is alive.
        self.leases.renew(entry.pool_id)
        return entry

    # ------------------------------------------------------------ pool calls
    def register(self, worker_id: str, shape: pb.PoolShape, replace_credential: str = "") -> Registration:
        """A new pool for `worker_id`. A live pool of the same worker id is
        replaced only with its credential; else PoolInUse until its lease
        expires (so nobody can drop another worker's pool by naming it)."""
        limit = self.limits.max_worker_id_len
        if not worker_id or len(worker_id) > limit or "/" in worker_id or not worker_id.isprintable():
            raise BadRequest(f"worker_id must be 1 to {limit} printable characters without '/'")
        config = config_from_proto(shape)
        credential = secrets.token_urlsafe(32)
        digest = _digest(credential)
        with self._lock:
            reg = self._fresh()
            old = reg.pools.get(reg.current.get(worker_id, ""))
            if old is not None:
                self._check_replace(old, replace_credential)
            pools = len(reg.pools) - (old is not None)
            if pools >= self.limits.max_pools:
                raise CapacityExceeded(f"the server holds its maximum of {self.limits.max_pools} pools")
            blocks = sum(e.pool.num_blocks for e in reg.pools.values()) - (old.pool.num_blocks if old else 0)
            if blocks + config.num_blocks > self.limits.max_total_blocks:
                raise CapacityExceeded(
                    f"{config.num_blocks} more blocks would exceed the server's "
                    f"{self.limits.max_total_blocks} (in use: {blocks})"
                )
            epoch = reg.next_epoch(worker_id)
            self._journal(
                registered=jpb.PoolRegistered(
                    pool_id=f"{worker_id}/{epoch}",
                    worker_id=worker_id,
                    epoch=epoch,
                    shape=shape,
                    credential_digest=digest,
                )
            )
            entry = reg.register(worker_id, epoch, config, digest)
            if old is not None:
                self.leases.forget(old.pool_id)
            self.leases.renew(entry.pool_id)
            self._changed()
        log.info("registered pool %s (%d blocks of %d)", entry.pool_id, config.num_blocks, config.block_size)
        return Registration(entry.pool_id, epoch, credential, self.config.lease_ttl_s)

    def _check_replace(self, old: PoolEntry, credential: str) -> None:
        if not credential:
            raise PoolInUse(
                f"worker id {old.worker_id!r} has a live pool {old.pool_id} (its lease expires in "
                f"{self.leases.remaining(old.pool_id):.1f} s unless renewed): present its credential "
                "as replace_credential to replace it, or wait for the lease to expire"
            )
        if not hmac.compare_digest(_digest(credential), old.credential_digest):
            raise PermissionDenied(f"replace_credential is not the credential of pool {old.pool_id!r}")

    def heartbeat(self, ref: pb.PoolRef) -> float:
        with self._lock:
            self._authorize(ref)
        return self.config.lease_ttl_s

    def deregister(self, ref: pb.PoolRef) -> None:
        with self._lock:
            self._fresh()
            entry = self._authorize(ref)
            self._drop(entry.pool_id, "deregistered")

    def _drop(self, pool_id: str, reason: str) -> None:
        self._journal(dropped=jpb.PoolDropped(pool_id=pool_id, reason=reason))
        self.registry.drop(pool_id, reason)
        self.leases.forget(pool_id)
        self._changed()
        log.info("dropped pool %s (%s)", pool_id, reason)

    def step(self, ref: pb.PoolRef, step_id: int, ops_msg: pb.StepOps,
             prev_step_id: int | None = None) -> pb.StepResponse:
        if step_id < 1:
            raise BadRequest("step_id must be positive")
        # Converting, validation and hashing need no lock.
        step = columns_from_proto(ops_msg)
        check_step(step, self.limits)
        digest = ops_digest(ops_msg)
        with self._lock:
            self._fresh()
            entry = self._authorize(ref)
            if step_id <= entry.last_step_id:
                if step_id == entry.last_step_id and digest == entry.last_digest:
                    return entry.last_response  # a retry: same answer, applied once
                if step_id == entry.last_step_id:
                    raise StepConflict(f"step {step_id} was already applied with other operations")
                raise StepConflict(f"step {step_id} is older than the pool's last step {entry.last_step_id}")
            if prev_step_id is not None and prev_step_id != entry.last_step_id:
                self._state_lost(entry, prev_step_id)
            self._journal(
                step=jpb.StepApplied(pool_id=entry.pool_id, step_id=step_id, digest=digest, ops=ops_msg)
            )
            response = self.registry.step(entry, step_id, digest, step)
            self._changed()
            return response

    def _state_lost(self, entry: PoolEntry, prev_step_id: int) -> None:
        """The worker got an answer for a step this server does not have (its
        journal lost records): drop the pool before it hands out a block the
        worker still uses; NOT_FOUND makes the worker re-register and recompute."""
        message = (
            f"pool {entry.pool_id} was dropped: its worker follows step {prev_step_id} but the "
            f"allocator's last step for it is {entry.last_step_id} (the allocator's state lost records)"
        )
        log.error("%s", message)
        self._drop(entry.pool_id, "state_lost")
        raise PoolStateLost(entry.pool_id, message)

    def block_table(self, ref: pb.PoolRef, seq_id: str) -> tuple[list[int], int]:
        with self._lock:
            pool = self._authorize(ref).pool
            return pool.block_table(seq_id), pool.num_tokens(seq_id)

    def stats(self, ref: pb.PoolRef, check_integrity: bool = False, admin: bool = False) -> pb.GetPoolStatsResponse:
        with self._lock:
            entry = self._authorize(ref, admin)
            problems = entry.pool.integrity_problems() if check_integrity else []
            return stats_to_proto(
                entry.pool.stats(),
                last_step_id=entry.last_step_id,
                integrity_problems=problems,
                integrity_checked=check_integrity,
            )

    def reset_prefix_cache(self, ref: pb.PoolRef, admin: bool = False) -> int:
        with self._lock:
            self._fresh()
            entry = self._authorize(ref, admin)
            self._journal(reset=jpb.PrefixCacheReset(pool_id=entry.pool_id))
            dropped = self.registry.reset_prefix_cache(entry)
            self._changed()
            return dropped

    def dump(self, ref: pb.PoolRef, admin: bool = False) -> tuple[dict[str, Any], int, list[str]]:
        with self._lock:
            entry = self._authorize(ref, admin)
            return entry.pool.to_state(), entry.last_step_id, entry.pool.integrity_problems()

    # ------------------------------------------------------- cross-pool calls
    def match_prefix(self, fingerprint: str, tokens: list[int], salt: str | None) -> list[pb.PrefixMatch]:
        if len(tokens) > self.limits.max_tokens_per_call:
            raise BadRequest(f"{len(tokens)} tokens; the limit is {self.limits.max_tokens_per_call}")
        if salt is not None and not 1 <= len(salt) <= MAX_SALT_LEN:
            raise InvalidArgument(f"cache_salt must be 1 to {MAX_SALT_LEN} characters (unset for no salt)")
        out = []
        with self._lock:
            for e in self.registry.pools.values():
                pool = e.pool
                if pool.config.model_fingerprint != fingerprint:
                    continue
                out.append(
                    pb.PrefixMatch(
                        pool_id=e.pool_id,
                        worker_id=e.worker_id,
                        cached_tokens=pool.cached_prefix_tokens(tokens, salt),
                        free_blocks=pool.num_free_blocks,
                        block_size=pool.block_size,
                    )
                )
        out.sort(key=lambda m: (-m.cached_tokens, -m.free_blocks, m.pool_id))
        return out

    def expire_leases(self) -> list[str]:
        """Drop every pool whose lease ran out (the reaper calls this)."""
        dropped: list[str] = []
        with self._lock:
            for pool_id in self.leases.expired():
                try:
                    reg = self._fresh()
                    if pool_id not in reg.pools:
                        self.leases.forget(pool_id)
                        continue
                    self._drop(pool_id, "lease_expired")
                except StoreUnavailable as exc:
                    log.warning("lease of %s expired but the drop cannot be journaled: %s", pool_id, exc)
                    break
                dropped.append(pool_id)
        return dropped

    def pool_views(self) -> list[PoolView]:
        with self._lock:
            return [PoolView(e.pool_id, e.worker_id, e.pool.stats()) for e in self.registry.pools.values()]

    # --------------------------------------------------------------- watchers
    def open_watcher(self) -> None:
        with self._watchers_lock:
            if self._watchers >= self.limits.max_watchers:
                raise CapacityExceeded(f"the server serves at most {self.limits.max_watchers} event streams")
            self._watchers += 1

    def close_watcher(self) -> None:
        with self._watchers_lock:
            self._watchers -= 1

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()
