"""Who serves: the leader lease, the standby that follows the journal, the
takeover and the step-down.

Every allocator with Redis state takes part (`RedisJournal.claim`, `renew`,
`tail`, `release`): the one that claimed the state holds the leader lease
(`<prefix>leader`, expiring after `lease_s`) and renews it every
`lease_s / RENEWALS` seconds; each claim takes the next fencing epoch, and
every journal write carries the claimant's token (`EPOCH:INSTANCE`), which
the write's Lua script checks against the owner key, so a claim fences off
every earlier leader at once. A start without `--standby` claims the state
at once (as a restart always has); a standby claims it only once no lease
is alive, and until then follows the journal every `FOLLOW_S`
(`DurableState.follow`: the same verified replay as a restart, one entry at
a time), so that taking over costs the records written since its last look.

- The leader dies (SIGKILL, a crash): its Redis connections close with it;
  the standby, which looks every `GONE_CHECK_S` for the lease holder's named
  connections (`RedisJournal.connected`), claims the state at once rather
  than wait for the lease (safe: a leader that was only cut off from Redis
  is fenced all the same). Where Redis does not list its clients, the lease
  decides, as below.
- The leader stops renewing (SIGSTOP, a pause): its lease runs out, the
  standby's next look finds no lease, claims the state (a new epoch),
  applies the rest of the journal and serves (`takeover`), within the lease
  time plus one look.
- The leader stops (SIGTERM): it gives the lease up (`release`), so the
  standby takes over at its next look.
- A deposed leader wakes up: its next write is FENCED (nothing is written,
  nothing changes in memory) and its next renewal finds the lease gone to
  another; either way it steps down (`DurableState.deposed`) and follows
  the new leader as a standby.

The role decides what clients get: a standby answers every call but the
health check with UNAVAILABLE `not_leader` and the leader's address
(`errors.NotLeader`, from the interceptor in `rpc/interceptors.py`).
Nothing here decides what the state is: that stays the journal's order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from allocator_service.store.durable import DurableState
from allocator_service.wire.errors import StoreUnavailable

log = logging.getLogger(__name__)

# A standby looks at the journal (and the lease) this often, seconds.
FOLLOW_S = 0.02
# The leader renews its lease this many times per lease time.
RENEWALS = 5
# What the log says when an instance steps down and when it takes over (drills read it).
DEPOSED = "leader lease: deposed"
TOOK_OVER = "leader lease: took over"
# A standby looks this often whether the lease holder's connections to Redis are still open.
GONE_CHECK_S = 0.1


def lease_holder(value: str) -> tuple[str, str]:
    """(token, address) of a leader lease's value (`TOKEN ADDRESS`)."""
    token, _, address = value.partition(" ")
    return token, address


class Leadership:
    """The role loop of one allocator (a thread: `run`)."""

    def __init__(self, durable: DurableState, on_takeover: Callable[[], None]) -> None:
        """`on_takeover()`: run under the mutation lock right after this
        instance took over (the service journals its start-up changes)."""
        self.durable = durable
        self.journal = durable.journal
        self.on_takeover = on_takeover
        self.lease_s = self.journal.lease_s
        self.takeovers = 0
        self.step_downs = 0
        self._leader = ""  # the lease's value as last seen by a standby
        self._gone_checked = 0.0  # when a standby last looked for the leader's connections
        self._lists_clients = True  # False once Redis refused CLIENT LIST

    @property
    def leader_address(self) -> str:
        """Where the leader serves (empty: unknown, no lease alive)."""
        if self.durable.leading:
            return self.journal.address
        return lease_holder(self._leader or self.journal.leader)[1]

    def run(self, stop: threading.Event) -> None:
        if not self.journal.durable:
            return
        while not stop.is_set():
            try:
                if self.durable.leading:
                    self._lead(stop)
                else:
                    self._follow(stop)
            except StoreUnavailable as exc:
                log.warning("leader lease: the state store failed: %s", exc)
                stop.wait(FOLLOW_S)
            except Exception:  # a bug must not stop the role loop
                log.exception("leader lease")
                stop.wait(FOLLOW_S)

    def _lead(self, stop: threading.Event) -> None:
        deposed = self.durable.deposed
        if deposed.wait(self.lease_s / RENEWALS) or stop.is_set():
            if deposed.is_set() and not stop.is_set():
                self._step_down("a journal write was fenced")
            return
        kept = self.journal.renew()
        if kept == 0:
            self._step_down("another instance holds the leader lease")
        elif kept < 0:
            log.warning(
                "leader lease: the owner key is gone from Redis; the next write finds the loss"
            )

    def _step_down(self, why: str) -> None:
        log.warning("%s (%s): stepping down to follow the new leader", DEPOSED, why)
        with self.durable.lock:
            self.durable.follow_from_start()
        self.step_downs += 1

    def _follow(self, stop: threading.Event) -> None:
        if stop.wait(FOLLOW_S):
            return
        with self.durable.lock:
            self._leader = self.durable.follow()
        gone = self._leader_gone()
        if (self._leader and not gone) or not self.journal.claim(
            force=False, gone=self._leader if gone else ""
        ):
            return
        if gone:
            log.warning(
                "leader lease: the leader's connections to Redis are gone (%s): taking over now",
                self._leader,
            )
        with self.durable.lock:
            self.durable.takeover()
            self.on_takeover()
        self.durable.after_change()
        self.takeovers += 1
        log.warning(
            "%s as leader (%s, epoch %s), record %d",
            TOOK_OVER,
            self.journal.address,
            self.journal.token.partition(":")[0],
            self.durable.registry.index,
        )

    def _leader_gone(self) -> bool:
        """Whether the lease holder's Redis connections are all gone (looked
        at every GONE_CHECK_S; never where Redis does not list clients)."""
        now = time.monotonic()
        if not self._leader or not self._lists_clients or now - self._gone_checked < GONE_CHECK_S:
            return False
        self._gone_checked = now
        instance = lease_holder(self._leader)[0].partition(":")[2]
        connected = self.journal.connected(instance)
        if connected is None:
            log.info(
                "leader lease: Redis does not list its clients; "
                "a dead leader is replaced when its lease runs out"
            )
            self._lists_clients = False
            return False
        return not connected

    def release(self) -> None:
        """At a graceful stop: give the lease up so a standby takes over now."""
        if self.journal.durable and self.durable.leading:
            try:
                self.journal.release()
            except StoreUnavailable as exc:
                log.warning("leader lease: could not give the lease up: %s", exc)
