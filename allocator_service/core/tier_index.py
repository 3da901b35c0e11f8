"""The tiers' indexes and counts: which keys each tier holds, where, in what
LRU order (`LruTier`; a worker's host tier, `HostSlotIndex`; the store an
allocator's pools share, `SharedStore`), the store's namespaces, and the
tiers' counters (`TierStats`, `StoreStats`). What moves where is decided in
`tiers.py`.

An `LruTier` maps key -> (location, size), each entry PENDING (a save was
issued) or PRESENT (confirmed). Invariants (`problems()`):
- a key is in at most one entry;
- `used` is the sum of the entries' sizes and never exceeds `capacity`;
- only present entries are found; only present, unpinned ones are victims (a
  pending entry goes only by its failure or its pool's drop)."""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, fields
from itertools import islice
from typing import Any

from allocator_service.core.errors import InvalidArgument
from allocator_service.core.limits import MAX_LAYOUT_LEN, MAX_STORE_GROUP_LEN, STORE_NAME_CHARS

_STORE_NAME = re.compile(f"[{STORE_NAME_CHARS}]*")


def check_store_names(layout: str, group: str) -> None:
    """InvalidArgument unless `layout` (a KV layout key) and `group` (a
    store group, "" for none) are words of STORE_NAME_CHARS within their
    bounds: then `store_namespace` can never make one group's namespace
    from another's names."""
    for what, value, bound in (
        ("layout", layout, MAX_LAYOUT_LEN),
        ("store_group", group, MAX_STORE_GROUP_LEN),
    ):
        if not isinstance(value, str) or len(value) > bound or not _STORE_NAME.fullmatch(value):
            raise InvalidArgument(
                f"{what} must be at most {bound} characters of [{STORE_NAME_CHARS}]"
            )


def store_namespace(group: str, layout: str) -> str:
    """Where a pool's blocks live in the shared store: its KV layout key,
    under its store group when it has one (`GROUP.LAYOUT`). Pools find each
    other's entries only within one namespace: one group (one trust domain,
    named by the operator) and one layout."""
    return f"{group}.{layout}" if group else layout


class LruTier:
    """Entries key -> (location, size), pending or present; present ones in
    LRU order (least recently used first). Capacity and sizes are in one
    unit (host tier: slots, each entry 1; store: bytes)."""

    __slots__ = ("capacity", "used", "_pending_used", "present", "pending", "_pinned")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0  # sizes of every entry, pending ones included
        self._pending_used = 0
        self.present: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()
        self.pending: dict[Hashable, tuple[int, int]] = {}
        # Keys loaded in the current step: not victims until `unpin_all`.
        self._pinned: dict[Hashable, None] = {}

    def __contains__(self, key: Hashable) -> bool:
        """Whether `key` has an entry (pending or present)."""
        return key in self.present or key in self.pending

    def __len__(self) -> int:
        return len(self.present) + len(self.pending)

    def find(self, key: Hashable) -> int | None:
        """The location of a PRESENT entry (None: not findable)."""
        e = self.present.get(key)
        return None if e is None else e[0]

    def touch(self, key: Hashable) -> int:
        """A present entry is read (loaded) this step: most recent, pinned."""
        self.present.move_to_end(key)
        self._pinned[key] = None
        return self.present[key][0]

    def add_pending(self, key: Hashable, loc: int, size: int) -> None:
        """A save was issued: a pending entry (the caller made room)."""
        assert key not in self and self.used + size <= self.capacity
        self.pending[key] = (loc, size)
        self.used += size
        self._pending_used += size

    def confirm(self, key: Hashable) -> bool:
        """A pending entry's bytes are written: it becomes present, most
        recent. False (nothing changes) when `key` is not pending."""
        e = self.pending.pop(key, None)
        if e is None:
            return False
        self._pending_used -= e[1]
        self.present[key] = e
        return True

    def drop(self, key: Hashable) -> tuple[int, int] | None:
        """Forget an entry, pending or present: its (location, size)."""
        e = self.present.pop(key, None)
        if e is None:
            e = self.pending.pop(key, None)
            if e is None:
                return None
            self._pending_used -= e[1]
        self._pinned.pop(key, None)
        self.used -= e[1]
        return e

    def victim(self) -> Hashable | None:
        """The least recently used present entry not pinned (None: none)."""
        pinned = self._pinned
        for key in self.present:  # pinned entries are most recent: few are passed
            if key not in pinned:
                return key
        return None

    def can_fit(self, size: int) -> bool:
        """Whether `size` fits once every victim there is is dropped."""
        pinned = sum(self.present[k][1] for k in self._pinned if k in self.present)
        return self.capacity - self._pending_used - pinned >= size

    def unpin_all(self) -> None:
        self._pinned.clear()

    def problems(self, name: str) -> list[str]:
        out = []
        both = [k for k in self.pending if k in self.present]
        if both:
            out.append(f"{name}: {len(both)} keys are both pending and present")
        used = sum(s for _, s in self.present.values()) + sum(s for _, s in self.pending.values())
        if used != self.used:
            out.append(f"{name}: counts {self.used} used, its entries hold {used}")
        if sum(s for _, s in self.pending.values()) != self._pending_used:
            out.append(f"{name}: the pending count is off")
        if self.used > self.capacity:
            out.append(f"{name}: {self.used} used over a capacity of {self.capacity}")
        return out


def _hex(key: bytes) -> str:
    return key.hex()


class HostSlotIndex:
    """One worker's host tier: slots 0..capacity-1, an `LruTier` of
    hash -> slot, the free slots in hand-out order, and which hash each
    slot holds (how a confirmation by slot finds its entry)."""

    __slots__ = ("lru", "free_slots", "slot_hash")

    def __init__(self, capacity: int) -> None:
        self.lru = LruTier(capacity)
        self.free_slots: deque[int] = deque(range(capacity))
        self.slot_hash: list[bytes | None] = [None] * capacity

    def to_state(self) -> dict[str, Any]:
        return {
            "capacity": self.lru.capacity,
            "present": [[h.hex(), s] for h, (s, _) in self.lru.present.items()],  # type: ignore[attr-defined]
            "pending": [[h.hex(), s] for h, (s, _) in self.lru.pending.items()],  # type: ignore[attr-defined]
            "free_slots": list(self.free_slots),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> HostSlotIndex:
        t = cls(state["capacity"])
        t.free_slots = deque(state["free_slots"])
        for part, target in (("present", t.lru.present), ("pending", t.lru.pending)):
            for h, s in state[part]:
                key = bytes.fromhex(h)
                target[key] = (s, 1)
                t.slot_hash[s] = key
        t.lru.used = len(t.lru.present) + len(t.lru.pending)
        t.lru._pending_used = len(t.lru.pending)
        return t

    def problems(self) -> list[str]:
        out = self.lru.problems("host tier")
        n = self.lru.capacity
        holders = [0] * n
        for key, (s, size) in [*self.lru.present.items(), *self.lru.pending.items()]:
            if not 0 <= s < n:
                out.append(f"host tier: an entry names slot {s}, out of range")
                continue
            holders[s] += 1
            if self.slot_hash[s] != key or size != 1:
                out.append(f"host tier: slot {s} is named by an entry it does not hold")
        for s in self.free_slots:
            if 0 <= s < n:
                holders[s] += 1
        for s, c in enumerate(holders):
            if c != 1:
                out.append(f"host tier: slot {s} is in {c} places (entries and free slots)")
        if len(set(self.free_slots)) != len(self.free_slots):
            out.append("host tier: a slot is listed twice as free")
        for s, h in enumerate(self.slot_hash):
            if h is not None and self.lru.present.get(h, self.lru.pending.get(h, (None,)))[0] != s:
                out.append(f"host tier: slot {s} says it holds a hash whose entry is elsewhere")
        return out


class SharedStore:
    """The store index shared by an allocator's pools: (namespace, hash) ->
    entry of `size` bytes, `capacity_bytes` in all. It is given to each pool
    that uses it (`BlockPool(config, store=...)`); the steps that touch it
    must be applied in one global order (their journal's). Which pool awaits
    a pending entry's confirmation is that pool's record (`PoolTiers`).
    `peer`: each entry's location is the pool id of its writer, which holds
    its bytes (else 0: the store holds them); `deletes`: per writer, the
    entries the index dropped on another pool's step, whose store deletes
    go out in the writer's next step (`PoolTiers.take_moves`)."""

    __slots__ = ("lru", "stats", "peer", "users", "deletes")

    def __init__(self, capacity_bytes: int, peer: bool = False) -> None:
        if type(capacity_bytes) is not int or capacity_bytes < 0:
            raise InvalidArgument(
                "the shared store's capacity must be a non-negative integer of bytes"
            )
        self.lru = LruTier(capacity_bytes)
        self.stats = StoreStats()
        self.peer = peer
        # Pools using the store, counted by whoever holds the pools (the allocator's
        # registry, from its journal and snapshots): each one's share of pending saves.
        self.users = 0
        self.deletes: dict[str, dict[tuple[str, bytes], None]] = {}

    def owe(self, writer: str, key: tuple[str, bytes]) -> None:
        """The index dropped peer entry `key` of `writer`: its delete is owed to it."""
        self.deletes.setdefault(writer, {})[key] = None

    def rewritten(self, writer: str, key: tuple[str, bytes]) -> None:
        """`writer` saves `key` again: its new bytes replace the old, no delete is owed."""
        owed = self.deletes.get(writer)
        if owed is not None and key in owed:
            del owed[key]
            if not owed:
                del self.deletes[writer]

    def take_owed(self, writer: str, most: int) -> list[tuple[str, bytes]]:
        """The first `most` deletes owed to `writer`, no longer owed."""
        owed = self.deletes.get(writer)
        if not owed:
            return []
        taken = list(islice(owed, most))
        for key in taken:
            del owed[key]
        if not owed:
            del self.deletes[writer]
        return taken

    def pending_share(self) -> int:
        """The most bytes of pending saves one pool may have: the whole store
        for a pool alone, else the capacity over the pools using it."""
        return self.lru.capacity // self.users if self.users > 1 else self.lru.capacity

    @property
    def capacity_bytes(self) -> int:
        return self.lru.capacity

    def to_state(self) -> dict[str, Any]:
        """A JSON-able dump; `from_state` rebuilds it exactly. A peer store's
        entries carry their writer's pool id (and the dump says `peer`)."""
        if self.peer:

            def entries(part):
                return [[lay, h.hex(), size, loc] for (lay, h), (loc, size) in part.items()]
        else:

            def entries(part):
                return [[lay, h.hex(), size] for (lay, h), (_, size) in part.items()]

        state = {
            "capacity_bytes": self.lru.capacity,
            "present": entries(self.lru.present),
            "pending": entries(self.lru.pending),
            "counters": self.stats.to_state(),
        }
        if self.peer:
            state["peer"] = True
            state["deletes"] = {
                w: [[lay, h.hex()] for lay, h in keys] for w, keys in self.deletes.items()
            }
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SharedStore:
        # (absent in dumps of stores that are not peer stores, and of older versions)
        st = cls(state["capacity_bytes"], peer=state.get("peer", False))
        for part, target in (("present", st.lru.present), ("pending", st.lru.pending)):
            for lay, h, size, *writer in state[part]:
                target[(lay, bytes.fromhex(h))] = (writer[0] if writer else 0, size)
        st.lru.used = sum(s for _, s in st.lru.present.values()) + sum(
            s for _, s in st.lru.pending.values()
        )
        st.lru._pending_used = sum(s for _, s in st.lru.pending.values())
        st.stats = StoreStats.from_state(state["counters"])
        st.deletes = {
            w: {(lay, bytes.fromhex(h)): None for lay, h in keys}
            for w, keys in state.get("deletes", {}).items()
        }
        return st

    def drop_writer(self, writer: str) -> int:
        """A peer store's writer `writer` (a pool id) is gone, and its
        entries' bytes with it: they leave the index (no store deletes: no
        one holds them). Returns how many."""
        lru = self.lru
        gone = [k for part in (lru.present, lru.pending) for k, e in part.items() if e[0] == writer]
        for key in gone:
            lru.drop(key)
        self.deletes.pop(writer, None)
        return len(gone)

    def integrity_problems(self) -> list[str]:
        return self.lru.problems("shared store")


@dataclass(slots=True)
class TierStats:
    """One pool's tier counts since its start, kept in its dumps. A hit is
    counted when its load is issued: a store load the worker refuses later
    stays counted here (the worker's own hit counts leave it out)."""

    host_hit_tokens: int = 0  # prompt tokens whose loads from the host tier admissions issued
    store_hit_tokens: int = 0  # ... from the shared store
    host_saves: int = 0  # KV -> host saves issued
    store_saves: int = 0  # KV -> store saves issued (at release or eviction)
    host_loads: int = 0
    store_loads: int = 0
    saves_confirmed: int = 0  # host and store saves a worker confirmed written
    saves_failed: int = 0  # ... reported failed (the entry is dropped)
    saves_skipped: int = 0  # saves not issued: no room that is not pending or pinned
    # store loads the worker reported refused (format, layout, checksum, seal, missing)
    refused_loads: int = 0
    host_evictions: int = 0  # host entries dropped for a new save
    stale_confirmations: int = 0  # confirmations of nothing pending (ignored)

    def to_state(self) -> dict[str, int]:
        return _counts_state(self, _TIER_KEYS)

    @classmethod
    def from_state(cls, counts: Mapping[str, int]) -> TierStats:
        return _counts_from_state(cls, counts, _TIER_KEYS)


@dataclass(slots=True)
class StoreStats:
    """The shared store's counts since its start, kept in its dumps."""

    refused_drops: int = 0  # present entries dropped because a worker refused their load
    evictions: int = 0  # present entries dropped to make room (store deletes issued)

    def to_state(self) -> dict[str, int]:
        return _counts_state(self, _STORE_KEYS)

    @classmethod
    def from_state(cls, counts: Mapping[str, int]) -> StoreStats:
        return _counts_from_state(cls, counts, _STORE_KEYS)


# The key each count is stored under in a dump, where it is not the field's name.
_TIER_KEYS = {"refused_loads": "refused"}


_STORE_KEYS = {"refused_drops": "refused", "evictions": "dropped"}


def _counts_state(stats: Any, keys: dict[str, str]) -> dict[str, int]:
    return {keys.get(f.name, f.name): getattr(stats, f.name) for f in fields(stats)}


def _counts_from_state(cls: Any, counts: Mapping[str, int], keys: dict[str, str]) -> Any:
    """The counts of a dump; a count it lacks (an older dump) is 0."""
    return cls(**{f.name: counts.get(keys.get(f.name, f.name), 0) for f in fields(cls)})
