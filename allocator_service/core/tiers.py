"""The KV tiers below a worker's KV pool: its host tier (`HostSlotIndex`, slots
`0..host_blocks-1`) and the store its allocator's pools share (`SharedStore`,
keyed by (store namespace, hash), capacity in bytes). This module decides every
move and indexes every location; the worker moves the bytes and confirms them.

Both are one `LruTier`: key -> (location, size), each entry PENDING (save
issued) or PRESENT (confirmed). Invariants (`problems()`):
- a key is in at most one entry;
- `used` is the sum of the entries' sizes and never exceeds `capacity`;
- only present entries are found; only present, unpinned ones are victims (a
  pending entry goes only by its failure or its pool's drop).

`PoolTiers`, one pool's side, saves a cached block to the store when its last
sequence frees it, and to each tier that lacks its hash when it leaves the KV
pool; a full host tier reuses its LRU slot, a full store drops LRU entries
(store deletes); a save that finds no room (all pending or pinned) is skipped.
A store save reads its KV block (`Moves.store_save_from`), whose bytes stay
until the step's forward pass, after the moves. A pool finds, confirms and
skips saves only against its own namespace (`store_namespace`).

A peer store (`SharedStore(peer=True)`, `--kv-shared-store peer://`) keeps
no bytes anywhere shared: an entry stays with the worker that wrote it, so
its location is its writer's pool id (`PoolTiers.writer`), each store load
names it (`Moves.store_load_from`), and the writer's pool takes its entries
with it when it is dropped.

A pool's pending store saves stay within its share of the store: all of it
while it is the only pool using the store, else the capacity over the number
of pools using it (`SharedStore.users`); a save past it is skipped, so one
pool that never confirms its saves cannot leave no room for the others'.

Determinism: decisions read only the tiers' state and the operations applied,
in order; no iteration depends on hashing, so a replay rebuilds the same state.
The reasons: docs/architecture.md, "Tiers".
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from allocator_service.core.errors import InvalidArgument
from allocator_service.core.limits import MAX_LAYOUT_LEN, MAX_STORE_GROUP_LEN, STORE_NAME_CHARS

HASH_LEN = 32  # bytes of a block hash (SHA-256)
HOST, STORE = 1, 2  # the tiers below the KV pool (tier 0), as `PoolTiers.find` names them
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
            "present": [[h.hex(), s] for h, (s, _) in self.lru.present.items()],
            "pending": [[h.hex(), s] for h, (s, _) in self.lru.pending.items()],
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
    its bytes (else 0: the store holds them)."""

    __slots__ = ("lru", "stats", "peer", "users")

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
        return st

    def drop_writer(self, writer: str) -> int:
        """A peer store's writer `writer` (a pool id) is gone, and its
        entries' bytes with it: they leave the index (no store deletes: no
        one holds them). Returns how many."""
        lru = self.lru
        gone = [k for part in (lru.present, lru.pending) for k, e in part.items() if e[0] == writer]
        for key in gone:
            lru.drop(key)
        return len(gone)

    def integrity_problems(self) -> list[str]:
        return self.lru.problems("shared store")


class Moves(NamedTuple):
    """The tier moves of one step, in the order the worker applies them,
    before the step's forward pass (copy-on-write copies come between the
    host saves and the loads). Every list is in issue order."""

    store_deletes: list[bytes]  # (0) hashes to remove from the store, best effort ...
    store_delete_layouts: list[str]  # ... each under this store namespace (any pool's)
    store_saves: list[bytes]  # (1) hashes to write to the store (this pool's namespace) ...
    store_save_from: list[int]  # ... each from this KV block
    host_saves: list[int]  # (2) (KV block, host slot) pairs, flattened
    host_loads: list[int]  # (4) (host slot, KV block) pairs, flattened
    store_loads: list[bytes]  # (4) hashes to read from the store (this pool's namespace) ...
    store_load_to: list[int]  # ... each into this KV block ...
    # ... each pulled from this writer (a peer store: its pool id; on the wire its URL); else []
    store_load_from: list[str]


NO_MOVES = Moves([], [], [], [], [], [], [], [], [])  # NOTE: shared, never mutated


class TierReport(NamedTuple):
    """What a worker reports in a step on the moves of earlier answers
    (`StepColumns.report`, applied before the step's operations): only a
    confirmed save makes an entry findable."""

    saved: list[int]  # host slots whose save (KV -> host) is written
    failed: list[int]  # host slots whose save could not be written
    store_saved: list[bytes]  # hashes whose store save is written
    store_failed: list[bytes]  # hashes whose store save could not be written
    refused: list[bytes]  # hashes of store loads refused (layout, checksum, missing)


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


class PoolTiers:
    """One pool's tiers: its `HostSlotIndex` (None: no host tier), the
    `SharedStore` it uses (None: none), its store `namespace`
    (`store_namespace`), the store saves it has pending, and
    the moves issued since the last `take_moves`; `writer`: its pool id, the
    location of the entries it writes to a peer store (set by the registry). `BlockPool` calls
    `released` when a cached block's last sequence frees it, `evicted` when
    a cached block leaves the KV pool, `find` and `load` at
    admission, `confirm` at the start of a step, and `take_moves` at its end."""

    __slots__ = (
        "host",
        "store",
        "namespace",
        "block_bytes",
        "store_pending",
        "stats",
        "_moves",
        "writer",
    )

    def __init__(
        self, host_blocks: int, store: SharedStore | None, namespace: str, block_bytes: int
    ) -> None:
        self.host = HostSlotIndex(host_blocks) if host_blocks else None
        self.store = store
        self.namespace = namespace
        self.block_bytes = block_bytes
        # Store saves this pool issued and its worker has not confirmed
        # (dropped from the store with the pool: a killed worker never confirms).
        self.store_pending: dict[bytes, None] = {}
        self.stats = TierStats()
        self._moves: Moves | None = None
        self.writer = ""

    # ---------------------------------------------------------------- moves
    def _m(self) -> Moves:
        if self._moves is None:
            self._moves = Moves([], [], [], [], [], [], [], [], [])
        return self._moves

    def take_moves(self) -> Moves:
        """The moves issued since the last call (the step's answer); ends
        the step: entries loaded in it are no longer pinned."""
        m = self._moves
        self._moves = None
        if self.host is not None:
            self.host.lru.unpin_all()
        if self.store is not None:
            self.store.lru.unpin_all()
        return NO_MOVES if m is None else m

    # ------------------------------------------------------------ admission
    def find(self, h: bytes) -> int | None:
        """The tier where a prompt block's hash is findable, HOST before
        STORE; None when in neither (pending entries are not found)."""
        if self.host is not None and h in self.host.lru.present:
            return HOST
        if self.store is not None and (self.namespace, h) in self.store.lru.present:
            return STORE
        return None

    def pin(self, found: Iterable[tuple[bytes, int]]) -> None:
        """The entries an admission will load (hash, tier): most recent and
        pinned before it takes any block, so no save it causes reuses them."""
        for h, tier in found:
            if tier == HOST:
                self.host.lru.touch(h)  # type: ignore[union-attr]
            else:
                self.store.lru.touch((self.namespace, h))  # type: ignore[union-attr]

    def load(self, h: bytes, tier: int, block: int, block_size: int) -> None:
        """Issue the load of a pinned entry into a fresh KV block."""
        m = self._m()
        if tier == HOST:
            m.host_loads.extend((self.host.lru.present[h][0], block))  # type: ignore[union-attr]
            self.stats.host_loads += 1
            self.stats.host_hit_tokens += block_size
        else:
            m.store_loads.append(h)
            m.store_load_to.append(block)
            store = self.store
            if store.peer:  # type: ignore[union-attr]
                m.store_load_from.append(store.lru.present[(self.namespace, h)][0])  # type: ignore[union-attr]
            self.stats.store_loads += 1
            self.stats.store_hit_tokens += block_size

    # ------------------------------------------------------------- eviction
    def released(self, block: int, h: bytes) -> None:
        """Cached KV block `block` (hash `h`) is freed by its last sequence:
        write it through to the store unless the store has it."""
        if self.store is not None:
            self._store_save(h, block)

    def evicted(self, block: int, h: bytes) -> None:
        """Cached KV block `block` is reused and no other block holds `h`:
        save it to each tier below that lacks it."""
        host = self.host
        if host is not None and h not in host.lru:
            slot = self._host_slot()
            if slot is None:
                self.stats.saves_skipped += 1
            else:
                host.lru.add_pending(h, slot, 1)
                host.slot_hash[slot] = h
                self._m().host_saves.extend((block, slot))
                self.stats.host_saves += 1
        if self.store is not None:
            self._store_save(h, block)

    def _host_slot(self) -> int | None:
        host = self.host
        assert host is not None
        if host.free_slots:
            return host.free_slots.popleft()
        v = host.lru.victim()
        if v is None:
            return None
        slot = host.lru.drop(v)[0]  # type: ignore[index]
        host.slot_hash[slot] = None
        self.stats.host_evictions += 1
        return slot

    def _store_save(self, h: bytes, src: int) -> None:
        st = self.store
        assert st is not None
        key = (self.namespace, h)
        if key in st.lru:
            return
        size = self.block_bytes
        if (len(self.store_pending) + 1) * size > st.pending_share() or not st.lru.can_fit(size):
            self.stats.saves_skipped += 1
            return
        m = self._m()
        while st.lru.used + size > st.lru.capacity:
            v = st.lru.victim()
            st.lru.drop(v)
            st.stats.evictions += 1
            m.store_deletes.append(v[1])  # type: ignore[index]
            m.store_delete_layouts.append(v[0])  # type: ignore[index]
        st.lru.add_pending(key, self.writer if st.peer else 0, size)
        self.store_pending[h] = None
        m.store_saves.append(h)
        m.store_save_from.append(src)
        self.stats.store_saves += 1

    # --------------------------------------------------------- confirmation
    def check_confirmations(
        self,
        saved: list[int],
        failed: list[int],
        store_saved: list[bytes],
        store_failed: list[bytes],
        refused: list[bytes],
    ) -> None:
        """InvalidArgument unless every id is one this pool could have issued."""
        n = self.host.lru.capacity if self.host is not None else 0
        for s in (*saved, *failed):
            if type(s) is not int or not 0 <= s < n:
                raise InvalidArgument(
                    f"a confirmed host save names slot {s!r}; the pool's host tier has {n} slots"
                )
        if (store_saved or store_failed or refused) and self.store is None:
            raise InvalidArgument(
                "store confirmations for a pool that does not use the shared store"
            )
        for h in (*store_saved, *store_failed, *refused):
            if type(h) is not bytes or len(h) != HASH_LEN:
                raise InvalidArgument(
                    f"a store confirmation must name a {HASH_LEN}-byte block hash"
                )

    def confirm(
        self,
        saved: list[int],
        failed: list[int],
        store_saved: list[bytes],
        store_failed: list[bytes],
        refused: list[bytes],
    ) -> None:
        """Apply a worker's report (checked by `check_confirmations` first):
        saves written become present, failed ones are dropped, refused store
        entries are dropped (and deleted). Ids of nothing pending are counted
        and ignored."""
        c = self.stats
        host = self.host
        for s in saved:
            h = host.slot_hash[s]  # type: ignore[union-attr]
            if h is not None and host.lru.confirm(h):  # type: ignore[union-attr]
                c.saves_confirmed += 1
            else:
                c.stale_confirmations += 1
        for s in failed:
            h = host.slot_hash[s]  # type: ignore[union-attr]
            if h is not None and h in host.lru.pending:  # type: ignore[union-attr]
                host.lru.drop(h)  # type: ignore[union-attr]
                host.slot_hash[s] = None  # type: ignore[union-attr]
                host.free_slots.append(s)  # type: ignore[union-attr]
                c.saves_failed += 1
            else:
                c.stale_confirmations += 1
        st = self.store
        pending = self.store_pending
        for h in store_saved:
            if h in pending:
                del pending[h]
                st.lru.confirm((self.namespace, h))  # type: ignore[union-attr]
                c.saves_confirmed += 1
            else:
                c.stale_confirmations += 1
        for h in store_failed:
            if h in pending:
                del pending[h]
                st.lru.drop((self.namespace, h))  # type: ignore[union-attr]
                self._m().store_deletes.append(h)  # a partial write, best effort
                self._m().store_delete_layouts.append(self.namespace)
                c.saves_failed += 1
            else:
                c.stale_confirmations += 1
        for h in refused:
            key = (self.namespace, h)
            c.refused_loads += 1
            if key in st.lru.present:  # type: ignore[union-attr]
                st.lru.drop(key)  # type: ignore[union-attr]
                st.stats.refused_drops += 1  # type: ignore[union-attr]
                self._m().store_deletes.append(h)
                self._m().store_delete_layouts.append(self.namespace)

    def drop_store_pending(self) -> int:
        """The pool is dropped: its unconfirmed store saves leave the store
        index (they never become hits), and in a peer store every entry it
        wrote (their bytes were its worker's). Returns how many."""
        n = 0
        if self.store is not None:
            for h in self.store_pending:
                if self.store.lru.drop((self.namespace, h)) is not None:
                    n += 1
            if self.store.peer:
                n += self.store.drop_writer(self.writer)
        self.store_pending.clear()
        return n

    # ------------------------------------------------------------ snapshots
    def to_state(self) -> dict[str, Any]:
        return {
            "host": self.host.to_state() if self.host is not None else None,
            "store_pending": [h.hex() for h in self.store_pending],
            "counters": self.stats.to_state(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        if state["host"] is not None:
            self.host = HostSlotIndex.from_state(state["host"])
        self.store_pending = {bytes.fromhex(h): None for h in state["store_pending"]}
        self.stats = TierStats.from_state(state["counters"])

    def problems(self) -> list[str]:
        out = self.host.problems() if self.host is not None else []
        if self.store is not None:
            out.extend(self.store.integrity_problems())
            for h in self.store_pending:
                if (self.namespace, h) not in self.store.lru.pending:
                    out.append(
                        f"store save {h.hex()[:12]} is pending for the pool, not in the store"
                    )
        elif self.store_pending:
            out.append("store saves are pending for a pool without a store")
        return out
