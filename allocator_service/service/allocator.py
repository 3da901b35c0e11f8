"""`AllocatorService`: the allocator as a transport-free object, composed of
its rooms, and its lifecycle (the lease reaper, the durable store's threads).

Rooms: `changes` (authorization, the journal before memory, the locks),
`pools` (registration, leases, quotas), `steps` (the Step path), `reads`
(one pool's and cross-pool reads) and `streams` (watchers, StepStreams); each
takes and returns domain values, the gRPC servicer and the HTTP port convert.
The reaper extends every lease by how late it woke (a pause, SIGSTOP), and
drops a pool for its lease only once it holds that pool's lock and the
mutation lock and finds the lease still expired.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from allocator_service.config import ServiceConfig
from allocator_service.core.pause_points import Unpaced
from allocator_service.fair_share import CallSlots, FairShare
from allocator_service.leases import LeaseTable
from allocator_service.service.changes import Changes
from allocator_service.service.pools import Pools
from allocator_service.service.reads import Reads
from allocator_service.service.steps import Steps
from allocator_service.service.streams import Streams
from allocator_service.store.durable import DurableState
from allocator_service.store.events import EventLog
from allocator_service.store.journal import MemoryJournal, RedisJournal
from allocator_service.store.leader import Leadership
from allocator_service.store.registry import Registry

log = logging.getLogger(__name__)


def _periodic(
    stop: threading.Event, interval: float, fn: Callable[[], Any], name: str
) -> threading.Thread:
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
        self.fair = FairShare(
            window or 1.0, max_wait_s=self.config.fair_share_max_wait_s, enabled=window > 0
        )
        # Slow reads in flight per pool (the servicer takes a slot per call).
        self.call_slots = CallSlots(self.limits.max_calls_per_pool, self.limits.max_slow_calls)
        lock = Unpaced()  # the mutation lock (changes.py)
        self.durable = DurableState(
            self.config, self.journal, self.events, self.leases, lock, clock
        )
        self.changes = Changes(self.durable, self.events, self.leases, lock)
        self.pools = Pools(self.changes, self.config)
        self.steps = Steps(self.changes, self.limits)
        self.reads = Reads(self.changes, self.limits)
        self.streams = Streams(self.limits)
        self.durable.drop_pools = self.pools.drop_pools
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clock = clock
        self.lease_extensions = 0  # times the reaper found the allocator had not run
        # Who serves (store/leader.py): a standby follows the leader's journal until it takes over.
        self.leadership = Leadership(self.durable, self.pools.configure_store)
        with lock:
            if self.durable.begin(standby=self.config.standby):
                self.pools.configure_store()
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
            self.pools.expire_leases()
            last[0] = self._clock()

        self._threads.append(_periodic(self._stop, interval, reap, "lease-reaper"))
        if self.journal.durable:  # health follows the state store
            self._threads.append(
                _periodic(self._stop, self.durable.store_check_s, self.check_store, "store-watch")
            )
            self.durable.background = True
            for target, name in (
                (self.durable.snapshot_loop, "snapshot"),
                (self.leadership.run, "leader-lease"),
            ):
                thread = threading.Thread(target=target, args=(self._stop,), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    def extend_if_late(self, late: float) -> None:
        """The reaper woke `late` seconds after it should have: the process
        did not run (paused, stopped, starved), so no worker could renew its
        lease meanwhile; every lease gets that time back."""
        if late > self.reaper_interval() / 2:
            self.leases.extend(late)
            self.lease_extensions += 1
            log.warning(
                "the allocator did not run for %.2f s (paused or stalled): every lease "
                "extended by that much",
                late,
            )

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.leadership.release()
        self.events.close()
        self.journal.close()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()
