"""The durable side of the allocator service: load and verified replay, the
journal write before each change, snapshots, the store watch and health.

The service (`service/changes.py`) calls in here with its mutation lock held
(`lock`: the one global order of records) for everything that touches the
order: `append` before a change, `changed` after it. Snapshots are taken off
the hot path, at a cut (`cut.py`).

Health tells the truth: unhealthy (`healthy`, and every listener added with
`add_health_listener`: the gRPC health status) while the state store is
unreachable, fenced by another instance, or lost what this instance wrote.
A store that lost its data is detected on the next write or by the store
watch; then every pool is dropped loudly (reason `state_lost`: their workers
get NOT_FOUND, re-register and recompute), the store is seeded again from
what is left (epochs and event numbers carry on, so no pool id is reissued),
and the service is healthy again.

A standby (`--standby`) holds the same registry without writing: `begin`,
`follow` and `takeover` are its side of `store/leader.py`. The journal anchor
(`store/anchor.py`) notes what this instance wrote, checked at every load.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from allocator_service.config import ServiceConfig
from allocator_service.core.pause_points import Unpaced
from allocator_service.leases import LeaseTable
from allocator_service.store.anchor import JournalAnchor
from allocator_service.store.cut import REDIS_MAX_VALUE_BYTES, SNAPSHOT_TOO_LARGE, Cut, over_share
from allocator_service.store.events import EventLog
from allocator_service.store.framing import (
    ZERO_CHAIN,
    StepRecord,
    encode_entry,
    encode_snapshot,
    encode_step_record,
    head_marker,
)
from allocator_service.store.journal import Loaded, MemoryJournal, RedisJournal
from allocator_service.store.registry import CorruptState, PoolEntry, Registry, pool_snapshot_json
from allocator_service.store.replay import Replayer, replay
from allocator_service.store.standby import Standby
from allocator_service.wire.errors import StoreFenced, StoreLost, StoreUnavailable
from allocator_service.wire.v1 import journal_pb2 as jpb

log = logging.getLogger(__name__)

# A failed (or skipped) snapshot is tried again after this, doubling up to the cap.
SNAPSHOT_BACKOFF_S = 1.0
SNAPSHOT_BACKOFF_CAP_S = 60.0


class DurableState(Standby):
    # How often the store watch looks at the state store (durable only).
    store_check_s = 1.0

    def __init__(
        self,
        config: ServiceConfig,
        journal: MemoryJournal | RedisJournal,
        events: EventLog,
        leases: LeaseTable,
        lock: Unpaced,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.journal = journal
        self.events = events
        self.leases = leases
        self.lock = lock  # the service's mutation lock: the one order of records
        self._clock = clock
        self.registry = Registry(events)
        self.anchor = JournalAnchor(config.journal_anchor_file, clock)
        self._stale = False  # memory may lack the last journal write: reload first
        self._chain = ZERO_CHAIN  # chain digest of the last record written
        self._head = b""  # the head marker that record set in the store
        self._lost: str | None = None  # the store lost our state: recover before serving
        self._health: tuple[bool, str] = (True, "")
        self._health_listeners: list[Callable[[bool, str], None]] = []
        self._since_snapshot = 0
        self._snapshot_index = 0  # the record index of the stored snapshot (0: none)
        self.snapshot_failures = 0
        self.snapshots_skipped = 0
        self._snapshot_streak = 0
        self._snapshot_not_before = 0.0
        self._cut: Cut | None = None
        self._generation = 0  # every load and reseed starts a new one: older cuts are void
        # Records whose pool part is being applied (outside the mutation lock).
        self._applying = 0
        self._applied = threading.Condition(threading.Lock())
        self._wake = threading.Event()
        self.background = False  # a snapshot thread runs (`start`)
        self.max_snapshot_bytes = min(config.max_snapshot_bytes, REDIS_MAX_VALUE_BYTES)
        # drop_pools(pool_ids, reason): journal and apply those drops, taking
        # the locks as a change does (the service sets it; None: nothing is dropped).
        self.drop_pools: Callable[[list[str], str], list[str]] | None = None
        self.pools_dropped_for_size = 0
        # The role (`store/leader.py`): leading (this instance writes and
        # serves) or following as a standby (`_follower` replays what the
        # leader writes); `deposed`: a write was fenced, step down.
        self.leading = True
        self._follower: Replayer | None = None
        self.deposed = threading.Event()

    # ------------------------------------------------------------- loading
    def load(self, take_ownership: bool) -> None:
        """Rebuild the registry from the journal (and its snapshot), checking
        every digest and chain (`replay`). Damage pinned on pools drops them
        loudly and the repaired state is stored at once as a new snapshot;
        damage that cannot be pinned on a pool raises CorruptState. The
        caller holds the mutation lock."""
        loaded = self.journal.load(take_ownership)
        self._quiesce()
        self._restore(loaded)

    def _restore(self, loaded: Loaded) -> None:
        """`load` of what the store held (mutation lock held)."""
        registry, report = replay(
            loaded.snapshot,
            loaded.entries,
            loaded.head,
            self.events,
            self.config.journal_key,
            self.anchor.read(),
        )
        fatal = report.fatal
        if fatal is not None:
            raise CorruptState(
                f"the journal in {self.journal.describe()} is damaged at {fatal}. Inspect it with "
                "`pagedkv allocator --state URL --check`; to start over, delete the keys "
                "<prefix>journal, <prefix>snapshot and <prefix>head (every worker then "
                "re-registers and recomputes once), and the journal anchor file if one is set: see "
                "docs/operations.md, 'A journal that cannot be replayed'"
            )
        self.registry = registry
        self._chain = report.chain
        self._head = head_marker(registry.index, self._chain) if loaded.head is not None else b""
        self.anchor.note(registry.index, self._chain, force=True)
        self.leases.rearm(list(registry.pools))
        self._since_snapshot = len(loaded.entries)
        self._snapshot_index = report.snapshot_index
        self._stale = False
        self._lost = None
        self._follower = None
        if not self.leading:
            self._set_role(leading=True)
        if report.snapshot_legacy or report.legacy_records:
            log.warning(
                "the journal was written by an older version (%d records without digests%s): "
                "loaded on index continuity alone; the next snapshot converts it",
                report.legacy_records,
                ", an undigested snapshot" if report.snapshot_legacy else "",
            )
        for problem in report.problems:
            log.error("journal check: %s", problem)
        if report.problems:
            log.error(
                "journal check: %d problem(s); pools dropped: %s; storing the repaired state",
                len(report.problems),
                ", ".join(report.dropped) or "none",
            )
            self._reseed()
        if loaded.snapshot is not None or loaded.entries:
            log.info(
                "restored %d pools from %s (snapshot at record %d, %d records replayed)",
                len(registry.pools),
                self.journal.describe(),
                report.snapshot_index,
                len(loaded.entries),
            )

    def _quiesce(self) -> None:
        """Wait until no record is being applied outside the mutation lock
        (the caller holds it, so none can start) and void any snapshot cut:
        the registry is about to be replaced or stored whole."""
        with self._applied:
            self._applied.wait_for(lambda: self._applying == 0)
        self._generation += 1
        self._cut = None

    def _reseed(self) -> None:
        """Store the registry as the whole new history (a snapshot, an empty
        journal, the head and the owner key)."""
        self._quiesce()
        self._head = head_marker(self.registry.index, self._chain)
        self.journal.reseed(
            encode_snapshot(self.registry.to_snapshot(self._chain), key=self.config.journal_key),
            self._head,
        )
        self.anchor.note(self.registry.index, self._chain, force=True)
        self._since_snapshot = 0
        self._snapshot_index = self.registry.index

    def fresh(self) -> Registry:
        """The registry, reloaded first if a journal write's fate is unknown."""
        if self._lost is not None:
            self._recover()
        if self._stale:
            with self.store_write():
                self.load(take_ownership=False)
        return self.registry

    @contextlib.contextmanager
    def store_write(self):
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
            log.warning("a write was fenced, nothing written (%s): stepping down", exc)
            self.deposed.set()  # another instance claimed the state: this one follows it now
            raise
        except StoreUnavailable:
            self._stale = True
            raise

    # ------------------------------------------------------ the hot path
    def append(self, **change: Any) -> None:
        """Journal one record (mutation lock held), before memory changes:
        `step=StepRecord(...)`, or one of the other changes as its message."""
        if not self.journal.durable:
            return
        index = self.registry.index + 1
        step: StepRecord | None = change.get("step")
        if step is not None:  # each pool's steps form a chain replay checks
            data = encode_step_record(index, step, self.registry.pools[step.pool_id].last_step_id)
        else:
            data = jpb.JournalRecord(index=index, **change).SerializeToString()
        entry, chain = encode_entry(self._chain, data, self.config.journal_key)
        head = head_marker(index, chain)
        with self.store_write():
            self.journal.append(entry, self._head, head)
        self._chain, self._head = chain, head
        self.anchor.note(index, chain)

    def begin_apply(self) -> None:
        """A record's pool part is about to run outside the mutation lock."""
        with self._applied:
            self._applying += 1

    def end_apply(self) -> None:
        with self._applied:
            self._applying -= 1
            if not self._applying:
                self._applied.notify_all()

    def changed(self) -> None:
        """After a record took its place (mutation lock held): maybe cut a
        snapshot. O(pools), never O(blocks)."""
        if not self.journal.durable:
            return
        self._since_snapshot += 1
        if (
            self._cut is None
            and self._since_snapshot >= self.config.snapshot_every
            and self._clock() >= self._snapshot_not_before
        ):
            self._take_cut()

    def _take_cut(self) -> None:
        """Note a snapshot cut as of now (mutation lock held)."""
        reg = self.registry
        marker = self.events.begin()
        self.events.finish(marker)
        entries = list(reg.pools.values())
        cut = Cut(
            reg.index,
            self._chain,
            reg.snapshot_header(self._chain, 0),
            marker,
            entries,
            self._generation,
            reg.index - self._snapshot_index,
        )
        for e in entries:
            e.snapshot_due = cut
        self._cut = cut
        self._since_snapshot = 0

    def after_change(self) -> None:
        """After a change, no lock held: a snapshot cut goes to the
        snapshot thread, or is written here when none runs."""
        if self._cut is None:
            return
        if self.background:
            self._wake.set()
        else:
            self.write_cut()

    def settle_store(self) -> None:
        """Before a record changes the shared store's index (mutation lock
        held): take it for the snapshot cut first, if it is still due."""
        cut = self._cut
        if cut is not None and cut.store_due:
            cut.store, cut.store_due = self.registry.store_state(), False

    @staticmethod
    def settle(entry: PoolEntry, index: int) -> None:
        """Before record `index` is applied to `entry` (its lock held):
        serialise the pool first for a snapshot cut it belongs to that does
        not include that record."""
        cut = entry.snapshot_due
        if cut is not None and cut.index < index:
            cut.parts[entry.pool_id] = pool_snapshot_json(entry)
            entry.snapshot_due = None

    # ------------------------------------------------------------ snapshots
    def snapshot_loop(self, stop: threading.Event) -> None:
        """The snapshot thread: writes each cut as it comes."""
        while not stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self._cut is not None and not stop.is_set():
                try:
                    self.write_cut()
                except Exception:
                    log.exception("snapshot")

    def write_cut(self) -> None:
        """Serialise the pending cut pool by pool (each under its own lock)
        and store it. No lock held by the caller."""
        cut = self._cut
        if cut is None:
            return
        recut = False
        try:
            recut = self._write(cut)
        finally:
            with self.lock:
                if self._cut is cut:
                    self._cut = None
                    if recut and cut.generation == self._generation:
                        self._take_cut()  # without the pools dropped for their size
        if recut and not self.background:
            self.write_cut()

    def _write(self, cut: Cut) -> bool:
        """Store `cut`; True when pools were dropped for their size instead
        (the cut is void: a new one is to be taken at once)."""
        for e in cut.entries:
            if e.snapshot_due is cut:
                with e.lock:
                    if e.snapshot_due is cut:
                        cut.parts[e.pool_id] = pool_snapshot_json(e)
                        e.snapshot_due = None
        with self.lock:
            if cut.generation == self._generation and cut.store_due:
                cut.store, cut.store_due = self.registry.store_state(), False
        next_event = self.events.numbered(cut.marker, timeout=30.0)
        if next_event is None or cut.generation != self._generation:
            return False  # the state was reloaded meanwhile: this cut is void
        header = dict(cut.header, next_event=next_event, store=cut.store)
        # the blob is the header, the parts, a comma between two, the magic and its digest
        room = (
            self.max_snapshot_bytes
            - len(encode_snapshot(header, [], self.config.journal_key))
            - len(cut.entries)
        )
        sizes = {e.pool_id: len(cut.parts[e.pool_id]) for e in cut.entries}
        drop = over_share(sizes, {e.pool_id: e.pool.num_blocks for e in cut.entries}, room)
        if drop:
            self.snapshots_skipped += 1
            log.error(
                "the snapshot at record %d would be %s bytes, over the bound of %s "
                "(PAGEDKV_ALLOCATOR_MAX_SNAPSHOT_MB, at most Redis's 512 MB value limit); dropping "
                "the pools over their share of it (reason %s): %s",
                cut.index,
                f"{sum(sizes.values()):,}",
                f"{self.max_snapshot_bytes:,}",
                SNAPSHOT_TOO_LARGE,
                ", ".join(f"{p} ({sizes[p]:,} bytes)" for p in drop),
            )
            dropped = (
                self.drop_pools(drop, SNAPSHOT_TOO_LARGE) if self.drop_pools is not None else []
            )
            self.pools_dropped_for_size += len(dropped)
            if dropped:
                return True
            self._back_off(
                f"the snapshot at record {cut.index} is not written: no pool could be dropped; "
                "the journal keeps every record"
            )
            return False
        blob = encode_snapshot(
            header, [cut.parts[e.pool_id] for e in cut.entries], self.config.journal_key
        )
        try:
            written = self.journal.write_snapshot(blob, cut.hint, cut.chain)
        except StoreLost as exc:
            with self.lock:
                if cut.generation == self._generation:
                    self._on_lost(str(exc))
            return False
        except (StoreUnavailable, StoreFenced) as exc:
            # Harmless: the journal still holds every record.
            self.snapshot_failures += 1
            self._back_off(f"snapshot not written: {exc}")
            return False
        if not written:
            self.snapshots_skipped += 1
            self._back_off(
                f"snapshot at record {cut.index} not written: the journal in the store no "
                "longer holds that record (the store was reseeded or lost records)"
            )
            return False
        self._snapshot_index = cut.index
        self._snapshot_streak = 0
        self._snapshot_not_before = 0.0
        return False

    def _back_off(self, why: str) -> None:
        delay = min(SNAPSHOT_BACKOFF_S * 2**self._snapshot_streak, SNAPSHOT_BACKOFF_CAP_S)
        self._snapshot_streak += 1
        self._snapshot_not_before = self._clock() + delay
        log.warning("%s (next try in %.1f s at the earliest)", why, delay)

    # ---------------------------------------------------- the store's health
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
        is no longer durable), then the store is seeded again. Mutation lock held."""
        self._set_health(False, f"the state store lost the allocator's state: {reason}")
        if self._lost is None:
            self._lost = reason
            self._quiesce()
            pools = list(self.registry.pools)
            log.error(
                "the state store lost the allocator's state (%s); dropping all %d pools: %s",
                reason,
                len(pools),
                ", ".join(pools) or "none",
            )
            for pool_id in pools:
                self.registry.drop_record(pool_id, "state_lost")
                self.leases.forget(pool_id)
            self._stale = False
        try:
            self._recover()
        except StoreUnavailable as exc:
            log.warning("the state store cannot be seeded again yet: %s", exc)

    def _recover(self) -> None:
        """Seed the store from memory after a loss (raises while it cannot)."""
        try:
            self._reseed()
        except StoreFenced:
            self.deposed.set()
            raise
        log.warning(
            "the state store holds a fresh history from record %d; workers re-register",
            self.registry.index,
        )
        self._lost = None
        self._set_health(True, "")

    def check_store(self) -> None:
        """One look at the state store (the store watch calls this): health
        follows what it finds, and a loss is acted on."""
        if not self.journal.durable or not self.leading:
            return  # a standby's look at the store is `follow`
        with self.lock:
            try:
                if self._lost is not None or self._stale:
                    self.fresh()
                else:
                    with self.store_write():
                        self.journal.probe(self._head)
            except (StoreLost, StoreFenced):
                return  # acted on, health set, by store_write
            except StoreUnavailable as exc:
                self._set_health(False, f"the state store is unreachable: {exc}")
                return
            self._set_health(True, "")

    def _set_role(self, leading: bool) -> None:
        changed = leading != self.leading
        self.leading = leading
        self._set_health(True, "")
        if changed:
            log.warning(
                "role: %s", "LEADER (serving)" if leading else "STANDBY (following the leader)"
            )
            for listener in self._health_listeners:
                listener(*self._health)
