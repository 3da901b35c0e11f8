"""A standby's side of the durable state (`DurableState`, `store/durable.py`):
`begin` claims the state or, while another instance leads, follows it
(`follow`: each entry the leader writes goes through the same verified
replay as a restart, `replay.Replayer`), and `takeover` makes it the leader
once it has claimed the state (the rest of the journal applied, the head
checked; anything unsound: the whole verified load). A leader whose write is
fenced (another instance claimed the state) is `deposed`: it follows again.
Who leads and when: `store/leader.py`.
"""

from __future__ import annotations

import logging

from allocator_service.store.framing import ZERO_CHAIN
from allocator_service.store.replay import Replayer

log = logging.getLogger("allocator_service.store.durable")


class Standby:
    """Mixed into `DurableState`, whose state it reads and sets (the
    registry, the chain and head, the leases, the role)."""

    def begin(self, standby: bool) -> bool:
        """At start (mutation lock held): claim the state and load it (True),
        or, as a standby while another instance holds the leader lease,
        follow it (False). Without `standby` the state is claimed at once."""
        if self.journal.claim(force=not standby):
            self.load(take_ownership=False)
            return True
        self.follow_from_start()
        return False

    def follow_from_start(self) -> None:
        """Follow the leader from the stored snapshot and journal, as a
        restart would load them (mutation lock held): at start as a
        standby, after being deposed, or when the journal no longer holds
        the next record this standby needs (a snapshot trimmed past it, a
        reseed)."""
        self._quiesce()
        loaded = self.journal.load(take_ownership=False, check_owner=False)
        follower = Replayer(
            loaded.snapshot, self.events, self.config.journal_key, self.anchor.read()
        )
        for raw in loaded.entries:
            if not follower.feed(raw):
                log.error(
                    "standby: the stored journal cannot be followed (%s); loading it again at the "
                    "next look",
                    follower.report.fatal,
                )
                break
        self._follow(follower, loaded.head or b"")
        self.leases.rearm([])  # a standby expires no lease: its leader does
        self._stale, self._lost = False, None
        self.deposed.clear()
        self._set_role(leading=False)

    def _follow(self, follower: Replayer, head: bytes) -> None:
        self._follower = follower
        self.registry = follower.registry
        self._chain = follower.chain if follower.chain is not None else ZERO_CHAIN
        self._head = head

    def follow(self) -> str:
        """One look at the store for a standby (mutation lock held): apply
        the entries the leader wrote since the last look. Returns the leader
        lease's value (empty: nobody holds it)."""
        tail = self.journal.tail(self.registry.index)
        follower = self._follower
        if tail.entries is None or follower is None or follower.stopped:
            self.follow_from_start()
            return tail.leader
        for raw in tail.entries:
            if not follower.feed(raw):
                log.error(
                    "standby: a journal entry cannot be followed (%s); loading the state again",
                    follower.report.fatal,
                )
                self.follow_from_start()
                return tail.leader
        self._follow(follower, tail.head)
        return tail.leader

    def takeover(self) -> None:
        """This standby claimed the state (mutation lock held): apply the
        rest of the journal and check it ends at the stored head, then serve
        from what it holds; a follower that met any problem loads the whole
        state instead (the verified load, which stores its repair)."""
        follower = self._follower
        tail = self.journal.tail(self.registry.index)
        sound = follower is not None and tail.entries is not None and not follower.report.problems
        if sound:
            for raw in tail.entries:
                follower.feed(raw)
            report = follower.finish(tail.head or None)
            sound = not report.problems
        if not sound:
            log.warning(
                "standby: the followed state is not sound; loading the whole state to take over"
            )
            self.load(take_ownership=False)
            return
        self._follow(follower, tail.head)
        self.anchor.note(self.registry.index, self._chain, force=True)
        self._snapshot_index = tail.base
        self._since_snapshot = self.registry.index - tail.base
        # every worker gets a full lease to find this server
        self.leases.rearm(list(self.registry.pools))
        self._follower = None
        self._stale, self._lost = False, None
        self.deposed.clear()  # a fenced write while it followed is not this term's
        self._set_role(leading=True)
