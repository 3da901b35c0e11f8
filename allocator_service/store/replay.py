"""The verified replay that checks every stored record and snapshot while
rebuilding the registry, and `pagedkv allocator --check`, which prints what
it found.

Each stored record is framed with a chained digest (`framing.encode_entry`),
each step record names the pool's previous step id, and a snapshot carries
its own digest and the chain digest it includes up to. `replay` checks all
three: a record whose digest fails but that names a live pool drops that
pool (`journal_corrupt`); a gap in the indices (a record removed) is
reported and every pool whose step chain then breaks is dropped
(`journal_gap`); a journal shorter than its head marker lost its tail
(reported: each pool whose last step was lost is dropped when its worker's
next Step names a step the server does not have). Whatever cannot be pinned
on one pool (an unreadable registration, a snapshot that fails its digest, a
record naming an unknown pool while nothing else was damaged) is fatal:
start-up stops with one line, never a guess.
"""

from __future__ import annotations

import hmac
import sys
from dataclasses import dataclass, field
from typing import NamedTuple

from google.protobuf.message import DecodeError

from allocator_service.store.anchor import Anchor
from allocator_service.store.events import EventLog
from allocator_service.store.framing import (
    FRAME,
    KEYED_ENTRY_MAGIC,
    ZERO_CHAIN,
    chain_digest,
    decode_snapshot,
    is_framed,
)
from allocator_service.store.journal import open_journal
from allocator_service.store.registry import CorruptState, Registry
from allocator_service.wire.v1 import journal_pb2 as jpb


class Problem(NamedTuple):
    """One thing replay found wrong. `position` is the entry's place in the
    stored journal (0 = first after the snapshot; -1 = the snapshot or the
    head), `index` the record index when known."""

    position: int
    index: int | None
    pool_id: str | None
    reason: str
    fatal: bool

    def __str__(self) -> str:
        where = "snapshot/head" if self.position < 0 else f"journal entry {self.position}"
        if self.index is not None:
            where += f" (record {self.index})"
        return f"{where}: {self.reason}"


@dataclass
class ReplayReport:
    snapshot_index: int = 0
    snapshot_legacy: bool = False
    records: int = 0
    legacy_records: int = 0
    head: str = ""
    problems: list[Problem] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    chain: bytes = ZERO_CHAIN  # the chain digest the next record follows

    @property
    def fatal(self) -> Problem | None:
        return next((p for p in self.problems if p.fatal), None)

    @property
    def sound(self) -> bool:
        return not self.problems


def _epoch_of(pool_id: str) -> tuple[str, int] | None:
    worker, _, epoch = pool_id.rpartition("/")
    return (worker, int(epoch)) if worker and epoch.isdigit() else None


def _pool_of(record: jpb.JournalRecord) -> str | None:
    kind = record.WhichOneof("change")
    return getattr(record, kind).pool_id if kind in ("step", "dropped", "reset") else None


class Replayer:
    """The verified replay, one stored entry at a time: `replay` feeds it a
    whole stored journal at start-up; a standby (`store/leader.py`) feeds
    it each entry as the leader writes it, so its registry is the one a
    restart would rebuild. Never raises on bad data: a problem that cannot
    be pinned on one pool is `fatal` in the report, and `feed` refuses every
    entry after it (the registry is then incomplete and must not be served)."""

    def __init__(
        self,
        snapshot: bytes | None,
        events: EventLog,
        key: bytes | None = None,
        anchor: Anchor | None = None,
    ) -> None:
        self.report = ReplayReport()
        self.key = key
        self.anchor = anchor  # the last record this instance wrote (`store/anchor.py`)
        self.registry = Registry(events)
        events.reset(1)
        # None: unknown (after a damaged entry or an older snapshot)
        self.chain: bytes | None = ZERO_CHAIN
        self.framed = False
        self.damaged = False
        self.last_raw = b""
        self.position = 0  # of the next entry, counted from the first after the snapshot
        self.stopped = False
        if snapshot is not None:
            try:
                snap, self.report.snapshot_legacy = decode_snapshot(snapshot, key)
                self.registry = Registry.from_snapshot(snap, events)
            except (CorruptState, KeyError, TypeError, ValueError) as exc:
                self._problem(-1, None, None, f"the snapshot cannot be used: {exc}", fatal=True)
                return
            self.report.snapshot_index = self.registry.index
            self.framed = not self.report.snapshot_legacy
            self.chain = bytes.fromhex(snap["chain"]) if "chain" in snap else None
            self._check_anchor(-1, self.registry.index)

    def _check_anchor(self, position: int, index: int) -> None:
        """Record `index` was just replayed: fatal if it is the anchored one
        with another chain digest (the store holds a different history)."""
        a = self.anchor
        if a is not None and a.index == index and self.chain is not None and self.chain != a.chain:
            self._problem(
                position,
                index,
                None,
                f"differs from record {index} as this allocator wrote it (its journal anchor): "
                "the state store holds another history",
                fatal=True,
            )

    def _problem(
        self,
        position: int,
        index: int | None,
        pool_id: str | None,
        reason: str,
        fatal: bool = False,
    ) -> None:
        self.report.problems.append(Problem(position, index, pool_id, reason, fatal))
        if fatal:
            self.stopped = True

    def _drop(self, pool_id: str, reason: str) -> None:
        self.registry.drop_record(pool_id, reason)
        self.report.dropped.append(pool_id)

    def feed(self, raw: bytes) -> bool:
        """Check and apply the next stored entry; False once replay stopped
        at a fatal problem."""
        if self.stopped:
            return False
        position = self.position
        self.position += 1
        self.report.records += 1
        registry, key, problem = self.registry, self.key, self._problem
        expected = registry.index + 1
        intact = True
        prev = None
        if is_framed(raw):
            prev, stored_chain, body = raw[4:36], raw[36:68], raw[FRAME:]
            keyed = raw.startswith(KEYED_ENTRY_MAGIC)
            if keyed and not key:
                problem(
                    position,
                    None,
                    None,
                    "is keyed (written with a journal key) and no journal key is "
                    "configured: set the allocator's journal key file",
                    fatal=True,
                )
                return False
            intact = keyed == bool(key) and hmac.compare_digest(
                chain_digest(prev, body, key), stored_chain
            )
            self.framed = True
        elif self.framed or key:
            body, stored_chain, intact = raw, None, False  # a frame that lost its magic
        else:
            body, stored_chain = raw, None
            self.report.legacy_records += 1
        try:
            record = jpb.JournalRecord.FromString(body)
        except DecodeError:
            record = None
        if record is None or not intact:
            pool_id = _pool_of(record) if record is not None else None
            if record is not None and record.index == expected and pool_id in registry.pools:
                problem(
                    position,
                    expected,
                    pool_id,
                    f"fails its digest; pool {pool_id} dropped (its state cannot be trusted)",
                )
                self._drop(pool_id, "journal_corrupt")
                self.damaged, self.chain, self.last_raw = True, None, raw
                return True
            what = "cannot be parsed" if record is None else "fails its digest"
            problem(
                position,
                expected,
                None,
                f"{what} and cannot be attributed to one live pool",
                fatal=True,
            )
            return False
        index = record.index
        if index < expected:
            if raw == self.last_raw:
                return True  # written twice by a retried call (older versions)
            problem(
                position,
                index,
                None,
                f"goes back to record {index} after record {expected - 1}",
                fatal=True,
            )
            return False
        if index > expected:
            problem(position, index, None, f"records {expected}..{index - 1} are missing")
            self.damaged = True
            registry.index = index - 1
        elif prev is not None and self.chain is not None and prev != self.chain:
            problem(
                position,
                index,
                None,
                "does not follow the record before it (a different history)",
                fatal=True,
            )
            return False
        self.last_raw = raw
        self.chain = (
            stored_chain if stored_chain is not None else (ZERO_CHAIN if not self.framed else None)
        )
        kind = record.WhichOneof("change")
        pool_id = _pool_of(record)
        if pool_id is not None and pool_id not in registry.pools:
            if self.damaged:
                # Its registration, or the record that made replay drop it,
                # was lost or damaged: skip what follows for it.
                problem(
                    position,
                    index,
                    pool_id,
                    f"names pool {pool_id}, lost with an earlier record: skipped",
                )
                owner = _epoch_of(pool_id)
                if owner is not None:
                    registry.remember_epoch(*owner)  # never reissue its id
                registry.index = index
                return True
            problem(position, index, pool_id, f"names unknown pool {pool_id}", fatal=True)
            return False
        if kind == "step" and stored_chain is not None:
            entry = registry.pools[pool_id]
            if record.step.prev_step_id != entry.last_step_id:
                problem(
                    position,
                    index,
                    pool_id,
                    f"step {record.step.step_id} follows step {record.step.prev_step_id} but the "
                    f"pool's last step is {entry.last_step_id}; pool {pool_id} dropped",
                )
                self._drop(pool_id, "journal_gap")
                registry.index = index
                self.damaged = True
                return True
        try:
            registry.apply(record)
        except CorruptState as exc:
            problem(position, index, pool_id, str(exc), fatal=True)
            return False
        except Exception as exc:  # a record the core refuses: name it, never a traceback
            problem(
                position,
                index,
                pool_id,
                f"cannot be applied ({type(exc).__name__}: {exc})",
                fatal=True,
            )
            return False
        self._check_anchor(position, index)
        return not self.stopped

    def finish(self, head: bytes | None) -> ReplayReport:
        """Check the head marker and the anchor against what was replayed; the report."""
        report, registry, chain, problem = self.report, self.registry, self.chain, self._problem
        report.chain = chain if chain is not None else ZERO_CHAIN
        report.head = "none" if head is None else head.decode(errors="replace")
        hidx, _, hchain = report.head.partition(":")
        if head is None:
            pass
        elif not hidx.isdigit():
            problem(-1, None, None, f"the head marker {report.head!r} is unreadable")
        elif int(hidx) > registry.index:
            problem(
                -1,
                int(hidx),
                None,
                f"the journal ends at record {registry.index} but its head says {hidx}: the last "
                f"{int(hidx) - registry.index} record(s) were lost (a pool whose last step was "
                "lost is dropped at its worker's next step)",
            )
        elif int(hidx) < registry.index:
            problem(
                -1,
                int(hidx),
                None,
                f"the head says record {hidx} but the journal holds {registry.index}",
            )
        elif chain is not None and hchain != chain.hex():
            problem(-1, int(hidx), None, "the head marker's digest differs from the last record's")
        if self.anchor is not None and self.anchor.index > registry.index:
            problem(
                -1,
                self.anchor.index,
                None,
                f"the state store ends at record {registry.index} but this allocator wrote "
                f"record {self.anchor.index} (its journal anchor): the store was rolled back "
                "or replaced",
                fatal=True,
            )
        return report


def replay(
    snapshot: bytes | None,
    entries: list[bytes],
    head: bytes | None,
    events: EventLog,
    key: bytes | None = None,
    anchor: Anchor | None = None,
) -> tuple[Registry, ReplayReport]:
    """Rebuild the registry from a stored snapshot and journal, checking
    every digest (keyed with `key`, the journal key, when given: then a
    record or snapshot not keyed with it fails), the record indices, each
    pool's step chain, the head marker and, when given, the `anchor` (the
    last record this instance wrote). Never raises on bad data: a problem
    that cannot be pinned on one pool is `fatal` in the report and replay
    stops there (the registry is then incomplete and must not be served)."""
    replayer = Replayer(snapshot, events, key, anchor)
    if replayer.stopped:
        return replayer.registry, replayer.report
    for raw in entries:
        if not replayer.feed(raw):
            return replayer.registry, replayer.report
    return replayer.registry, replayer.finish(head)


def check(
    state: str, out=sys.stdout, key: bytes | None = None, anchor: Anchor | None = None
) -> int:
    """`--check`: verify the journal stored at `state` (its digests keyed
    with `key`, the journal key, and against `anchor`, when given) without
    serving or writing; print what was found; 0 if sound, 1 if not."""
    journal = open_journal(state)
    if not journal.durable:
        print("pagedkv allocator --check: --state memory keeps no journal to check", file=out)
        return 1
    try:
        loaded = journal.load(take_ownership=False, check_owner=False)
    finally:
        journal.close()
    registry, report = replay(
        loaded.snapshot, loaded.entries, loaded.head, EventLog(1), key, anchor
    )
    p = lambda text: print(text, file=out)  # noqa: E731
    p(f"state: {journal.describe()}")
    p(
        "journal key: "
        f"{'yes (digests are HMAC-SHA256 under it)' if key else 'none (Redis is trusted)'}"
    )
    if loaded.snapshot is None:
        p("snapshot: none")
    else:
        p(
            f"snapshot: up to record {report.snapshot_index}"
            f"{' (older format, no digest)' if report.snapshot_legacy else ', digest ok'}"
        )
    legacy = report.legacy_records
    p(
        f"journal: {report.records} records after the snapshot"
        f"{f' ({legacy} without digests: older format)' if legacy else ''}"
    )
    p(f"head: {report.head}")
    if anchor is not None:
        p(f"journal anchor: record {anchor.index}")
    p(f"last record: {registry.index}")
    p(f"pools: {len(registry.pools)}")
    for entry in registry.pools.values():
        p(f"  {entry.pool_id}: {entry.pool.num_blocks} blocks, last step {entry.last_step_id}")
    if report.problems:
        p(f"problems: {len(report.problems)}")
        for problem in report.problems:
            p(f"  {'FATAL ' if problem.fatal else ''}{problem}")
        if report.fatal is not None:
            p(
                "verdict: NOT sound; the allocator refuses to start on it "
                "(see docs/operations.md, 'A journal that cannot be replayed')"
            )
        else:
            p(
                "verdict: NOT sound; a start drops "
                f"{', '.join(report.dropped) or 'no pool'} and stores the repair"
            )
        return 1
    p("problems: none")
    p("verdict: sound")
    return 0
