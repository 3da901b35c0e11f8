"""The moves between a worker's KV pool and the tiers below it: its host tier
and the store its allocator's pools share. `PoolTiers` decides every move and
records every location in the tiers' indexes (`tier_index.py`: `LruTier`, its
entries PENDING (save issued) or PRESENT (confirmed), and their invariants);
the worker moves the bytes and confirms them (`TierReport`).

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
with it when it is dropped. An entry the index drops goes out as a store
delete to its writer: in this step's answer when this pool wrote it, else in
the writer's next step (`SharedStore.deletes`), so a writer's memory keeps
only what the index can find (and what its next step deletes).

A pool's pending store saves stay within its share of the store: all of it
while it is the only pool using the store, else the capacity over the number
of pools using it (`SharedStore.users`); a save past it is skipped, so one
pool that never confirms its saves cannot leave no room for the others'.

Determinism: decisions read only the tiers' state and the operations applied,
in order; no iteration depends on hashing, so a replay rebuilds the same state.
The reasons: docs/architecture.md, "Tiers".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from allocator_service.core.block_hashes import HASH_BYTES
from allocator_service.core.errors import InvalidArgument
from allocator_service.core.tier_index import (
    HostSlotIndex,
    SharedStore,
    TierStats,
)

HOST, STORE = 1, 2  # the tiers below the KV pool (tier 0), as `PoolTiers.find` names them
# The most deletes other pools left a peer store writer that one of its answers carries (the rest
# go in its next ones): each is a hash and a namespace, so the answer stays small.
OWED_DELETES_PER_STEP = 1024


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

    def _store_delete(self, key: tuple[str, bytes], writer: str | int) -> None:
        """The store delete of `key`, which the index dropped; `writer`: its
        location. A peer store entry another pool wrote is deleted by that
        pool's worker, which holds its bytes, in its next step."""
        st = self.store
        if st.peer and writer != self.writer:  # type: ignore[union-attr]
            st.owe(writer, key)  # type: ignore[union-attr,arg-type]
            return
        m = self._m()
        m.store_deletes.append(key[1])
        m.store_delete_layouts.append(key[0])

    def take_moves(self) -> Moves:
        """The moves issued since the last call (the step's answer), with
        the deletes of this pool's peer store entries other pools dropped (at
        most OWED_DELETES_PER_STEP, the rest in the next answers); ends the
        step: entries loaded in it are no longer pinned."""
        if self.store is not None and self.store.deletes:
            for lay, h in self.store.take_owed(self.writer, OWED_DELETES_PER_STEP):
                self._m().store_deletes.append(h)
                self._m().store_delete_layouts.append(lay)
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
                m.store_load_from.append(store.lru.present[(self.namespace, h)][0])  # type: ignore[union-attr,arg-type]
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
            self._store_delete(v, st.lru.drop(v)[0])  # type: ignore[arg-type,index]
            st.stats.evictions += 1
        if st.peer:
            st.rewritten(self.writer, key)
        st.lru.add_pending(key, self.writer if st.peer else 0, size)  # type: ignore[arg-type]
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
            if type(h) is not bytes or len(h) != HASH_BYTES:
                raise InvalidArgument(
                    f"a store confirmation must name a {HASH_BYTES}-byte block hash"
                )

    def confirm(
        self,
        saved: list[int],
        failed: list[int],
        store_saved: list[bytes],
        store_failed: list[bytes],
        refused: list[bytes],
        holds: Callable[[bytes], bool],
    ) -> None:
        """Apply a worker's report (checked by `check_confirmations` first):
        saves written become present, failed ones are dropped, refused store
        entries the pool `holds` are dropped (and deleted). Ids of nothing
        pending, and refusals of hashes the pool does not hold, are counted
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
                key = (self.namespace, h)
                self._store_delete(key, st.lru.drop(key)[0])  # type: ignore[union-attr,index]
                c.saves_failed += 1  # (its delete: a partial write, best effort)
            else:
                c.stale_confirmations += 1
        for h in refused:
            if not holds(h):
                c.stale_confirmations += 1
                continue
            key = (self.namespace, h)
            c.refused_loads += 1
            if key in st.lru.present:  # type: ignore[union-attr]
                self._store_delete(key, st.lru.drop(key)[0])  # type: ignore[union-attr,index]
                st.stats.refused_drops += 1  # type: ignore[union-attr]

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
