"""Property-based (hypothesis) test of the tiered core against a reference
worker.

One or two pools (a tiny KV pool, so blocks are evicted all the time, a host
tier of a few slots or none, the shared store or not) share one small store.
Random steps (frees, forks, appends, admissions of prompts over a tiny
alphabet, so prefixes repeat) go through `run_step`. The reference worker
applies each answer's moves in the documented order, as a worker would,
tracking which block hash's bytes every KV block, host slot and store key
really holds: a save's bytes are read when the save is applied and land only
when the worker confirms them (`saved`, in a later step, at a time of its
choosing), a failed save leaves garbage, some store loads are refused (the
worker computes the block itself) and some store deletes are lost. Then the
step's forward pass writes the blocks it computes.

After every step: the pools are sound (`integrity_problems`), every present
host or store entry names a location holding its hash's bytes, every block
of every sequence holds the bytes of its own prompt's hash chain (so a load
brought the right bytes and a pending entry was never a hit), every block the
prefix cache can find holds its hash's bytes, and the capacities hold, each
pool's pending store saves within its share of the store.

With a peer store (`peer://`) an entry's bytes are its writer's: each worker
keeps what it saved, deletes only in its own memory (the allocator sends
each delete to the entry's writer: its memory holds only what the index
finds, what it is owed, and what a lost delete left), every load names the
writer it reads from, and a pool dropped mid-run (its worker's memory gone)
takes its entries out of the index, so no present entry lacks its bytes.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from allocator_service.core import (
    Admit,
    Append,
    BlockPool,
    Fork,
    Free,
    PoolConfig,
    run_step,
    step_columns,
)
from allocator_service.core.hashing import chain_hashes
from allocator_service.core.step import StepAnswer
from allocator_service.core.tier_index import SharedStore
from tests.support.allocator import tier_report
from tests.support.tiers import CONVERSATIONS, FATES

GARBAGE = "garbage"  # what a failed save leaves in its location
BLOCK_BYTES = 10
LAYOUT = "layout-a"


class Worker:
    """What one pool's worker knows and holds: its sequences' tokens, the
    bytes of its KV blocks and host slots, and its saves in flight."""

    def __init__(self, pool: BlockPool, writer: str = "") -> None:
        self.pool = pool
        self.writer = writer
        pool.tiers.writer = writer
        self.B = pool.block_size
        self.kv: list[object] = [None] * pool.num_blocks
        self.host: list[object] = [None] * pool.config.host_blocks
        self.tokens: dict[str, list[int]] = {}
        self.flight_host: dict[int, object] = {}  # slot -> bytes read at apply time
        self.flight_store: dict[bytes, object] = {}  # hash -> bytes read at apply time
        self.refused: list[bytes] = []

    def chain(self, sid: str) -> list[bytes]:
        return chain_hashes(self.pool.root_hash, self.tokens[sid], self.B)


class TiersMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.workers: list[Worker] = []
        # (layout, hash) -> bytes; a peer store: (writer, layout, hash) -> bytes
        self.store_bytes: dict[tuple, object] = {}
        # Where a store delete was lost (best effort): bytes left that nobody finds.
        self.lost_deletes: set[tuple] = set()
        # Corrupt entries a worker found and died before reporting: they stay in the
        # index (present, with garbage) until another worker's load refuses them too.
        self.unreported: set[bytes] = set()
        self.counter = 0

    @initialize(
        pools=st.integers(1, 2),
        num_blocks=st.integers(2, 6),
        block_size=st.sampled_from([1, 2, 3]),
        host_blocks=st.sampled_from([0, 0, 1, 2, 4]),
        use_store=st.booleans(),
        store_entries=st.integers(0, 8),
        peer=st.booleans(),
    )
    def setup(
        self, pools, num_blocks, block_size, host_blocks, use_store, store_entries, peer
    ) -> None:
        if not host_blocks:
            use_store = True
        self.store = SharedStore(store_entries * BLOCK_BYTES, peer=peer)
        for i in range(pools):
            config = PoolConfig(
                num_blocks,
                block_size,
                True,
                "tiers",
                host_blocks=host_blocks,
                layout=LAYOUT,
                block_bytes=BLOCK_BYTES,
                use_shared_store=use_store or i == 1,
            )
            self.workers.append(Worker(BlockPool(config, store=self.store), f"w{i}"))
            self.store.users += config.use_shared_store  # as the allocator's registry counts them

    def _at(self, writer: str, layout: str, h: bytes) -> tuple:
        """Where an entry's bytes are: the store's, or in a peer store its writer's."""
        return (writer, layout, h) if self.store.peer else (layout, h)

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    @rule(data=st.data())
    def step(self, data) -> None:
        w = self.workers[data.draw(st.integers(0, len(self.workers) - 1))]
        ops: list = []
        ids = sorted(w.tokens)
        frees = data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=2)) if ids else []
        ops += [Free(s) for s in frees]
        live = [s for s in ids if s not in frees]
        forks = {}
        for parent in (
            data.draw(st.lists(st.sampled_from(live), unique=True, max_size=1)) if live else []
        ):
            forks[self._new_id()] = parent
            ops.append(Fork(parent, next(reversed(forks))))
        appends = {}
        for s in (
            data.draw(st.lists(st.sampled_from(live), unique=True, max_size=2)) if live else []
        ):
            appends[s] = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=2 * w.B))
            ops.append(Append(s, appends[s]))
        admits = {}
        for _ in range(data.draw(st.integers(0, 2))):
            sid = self._new_id()
            # A turn of one of a few conversations: prompts share prefixes.
            base = data.draw(st.sampled_from(CONVERSATIONS))[: data.draw(st.integers(1, 4 * w.B))]
            prompt = base + data.draw(st.lists(st.integers(0, 1), max_size=2))
            admits[sid] = (prompt, data.draw(st.sampled_from([None, None, 1, 2])))
            ops.append(Admit(sid, admits[sid][0], None, admits[sid][1]))
        step = step_columns(ops, tier_report(**self._report(w, data)))
        result = run_step(w.pool, step)
        self._apply(w, data, ops, result)

    def _report(self, w: Worker, data) -> dict:
        """Which saves in flight land now, fail, or stay in flight."""
        saved, failed, store_saved, store_failed = [], [], [], []
        for slot in list(w.flight_host):
            fate = data.draw(st.sampled_from(FATES))
            if fate == "land":
                w.host[slot] = w.flight_host.pop(slot)
                saved.append(slot)
            elif fate == "fail":
                del w.flight_host[slot]
                w.host[slot] = GARBAGE
                failed.append(slot)
        for h in list(w.flight_store):
            fate = data.draw(st.sampled_from(FATES))
            if fate == "land":
                self.store_bytes[self._at(w.writer, LAYOUT, h)] = w.flight_store.pop(h)
                store_saved.append(h)
            elif fate == "fail":
                del w.flight_store[h]
                self.store_bytes[self._at(w.writer, LAYOUT, h)] = GARBAGE
                store_failed.append(h)
        refused, w.refused = w.refused, []
        return {
            "saved": saved,
            "failed": failed,
            "store_saved": store_saved,
            "store_failed": store_failed,
            "refused": refused,
        }

    def _apply(self, w: Worker, data, ops: list, r: StepAnswer) -> None:
        """Apply the answer's moves in order, then the forward pass."""
        B, m = w.B, r.moves
        for h, layout in zip(m.store_deletes, m.store_delete_layouts, strict=True):  # (0)
            if data.draw(st.booleans()):  # best effort: some are lost
                self.store_bytes.pop(self._at(w.writer, layout, h), None)
            else:
                self.lost_deletes.add(self._at(w.writer, layout, h))
        for h, src in zip(m.store_saves, m.store_save_from, strict=True):  # (1)
            assert h not in w.flight_store
            # a freed or evicted KV block: its bytes are its hash's until the forward pass
            assert w.kv[src] == h
            w.flight_store[h] = w.kv[src]
        saves = m.host_saves
        for i in range(0, len(saves), 2):  # (2)
            b, slot = saves[i], saves[i + 1]
            assert slot not in w.flight_host, "a slot was reused while its save is in flight"
            w.flight_host[slot] = w.kv[b]
        for i in range(0, len(r.copies), 2):  # (3)
            w.kv[r.copies[i + 1]] = w.kv[r.copies[i]]
        loads = m.host_loads
        loaded = set()
        for i in range(0, len(loads), 2):  # (4)
            w.kv[loads[i + 1]] = w.host[loads[i]]
            loaded.add(loads[i + 1])
        sources = m.store_load_from or [""] * len(m.store_loads)
        assert len(sources) == len(m.store_loads) and (m.store_load_from != []) == (
            self.store.peer and m.store_loads != []
        )
        for h, b, src in zip(m.store_loads, m.store_load_to, sources, strict=True):
            loaded.add(b)
            key = self._at(src, LAYOUT, h)
            if (LAYOUT, h) in self._corrupt() or data.draw(st.integers(0, 3)) == 0:
                # Corrupt (a bad checksum): refused, computed in the forward pass.
                self.store_bytes[key] = GARBAGE
                if h not in w.refused:
                    w.refused.append(h)
                w.kv[b] = h
            else:
                w.kv[b] = self.store_bytes.get(key, "missing")
        # The forward pass: the blocks each operation computes.
        results = iter(
            zip(r.errors, r.keep, r.num_appended, r.cached_tokens, r.num_stored, strict=True)
        )
        a = 0
        for op in ops:
            err, keep, na, cached, stored = next(results)
            new = r.appended[a : a + na]
            a += na
            if isinstance(op, Free):
                assert err == 0
                del w.tokens[op.seq]
            elif isinstance(op, Fork):
                assert err == 0
                w.tokens[op.child] = list(w.tokens[op.parent])
            elif isinstance(op, Append):
                if err:
                    continue
                start = len(w.tokens[op.seq])
                w.tokens[op.seq] += op.tokens
                self._compute(w, op.seq, start // B)
            elif isinstance(op, Admit):
                if err:
                    continue
                w.tokens[op.seq] = list(op.tokens[:stored])
                assert new == w.pool.block_table(op.seq)
                for b in new[: cached // B]:  # shared or loaded, never computed
                    assert w.kv[b] is not None
                self._compute(w, op.seq, cached // B)
        assert loaded <= set(r.appended), "a load into a block no admission took"

    def _corrupt(self) -> set:
        """Store keys found corrupt whose refusal is not reported yet."""
        return {(LAYOUT, h) for h in self.unreported} | {
            (LAYOUT, h) for w in self.workers for h in w.refused
        }

    def _compute(self, w: Worker, sid: str, first: int) -> None:
        table, chain = w.pool.block_table(sid), w.chain(sid)
        for i in range(first, len(table)):
            w.kv[table[i]] = chain[i] if i < len(chain) else ("partial", sid)

    @invariant()
    def sound(self) -> None:
        if not self.workers:
            return
        lru = self.store.lru
        assert lru.used <= lru.capacity
        corrupt = self._corrupt()  # the allocator learns of these with the next step
        for (layout, h), (loc, size) in lru.present.items():
            assert size == BLOCK_BYTES
            assert (layout, h) in corrupt or self.store_bytes.get(self._at(loc, layout, h)) == h, (
                "a store entry without its bytes"
            )
        for w in self.workers:
            pool = w.pool
            assert pool.integrity_problems() == []
            # within its share of pending saves: all of the store alone, half of it of two
            assert len(pool.tiers.store_pending) * BLOCK_BYTES <= self.store.pending_share()
            host = pool.tiers.host
            if host is not None:
                assert len(host.lru) <= pool.config.host_blocks
                slots = [s for s, _ in [*host.lru.present.values(), *host.lru.pending.values()]]
                assert len(slots) == len(set(slots))
                for h, (s, _) in host.lru.present.items():
                    assert w.host[s] == h, "a host entry without its bytes"
            for sid in w.tokens:
                table, chain = pool.block_table(sid), w.chain(sid)
                assert pool.num_tokens(sid) == len(w.tokens[sid])
                for i, h in enumerate(chain):
                    assert w.kv[table[i]] == h, (
                        f"{sid}: block {i} holds other bytes than its prompt's"
                    )
            for h, holders in pool.index.entries():
                for b in holders:
                    assert w.kv[b] == h, "the prefix cache finds a block without its bytes"

    @invariant()
    def writers_hold_only_what_the_index_finds(self) -> None:
        """A peer store: each writer's memory holds entries the index names it
        the writer of, the deletes it is owed (its next step's), and those
        whose delete was lost; nothing another pool dropped stays behind."""
        if not self.store.peer:
            return
        lru = self.store.lru
        for key in self.store_bytes:
            writer, layout, h = key
            entry = lru.present.get((layout, h)) or lru.pending.get((layout, h))
            assert (
                (entry is not None and entry[0] == writer)
                or (layout, h) in self.store.deletes.get(writer, ())
                or key in self.lost_deletes
            ), "a writer holds bytes of an entry nobody finds, and no delete is owed"

    @precondition(lambda self: len(self.workers) == 2 and self.counter >= 12)
    @rule(now=st.integers(0, 3))
    def drop_a_pool(self, now: int) -> None:
        """A second pool's worker dies (late in a run: once the tiers hold
        something): its pool is dropped, and in a peer store the bytes it
        held with it."""
        if now:
            return
        w = self.workers.pop()
        self.unreported.update(w.refused)  # it dies before its next step reports them
        w.pool.drop_store_pending()
        self.store.users -= w.pool.config.use_shared_store  # as the registry counts them
        if self.store.peer:
            self.store_bytes = {k: v for k, v in self.store_bytes.items() if k[0] != w.writer}
            lru = self.store.lru
            assert all(loc != w.writer for loc, _ in [*lru.present.values(), *lru.pending.values()])

    def teardown(self) -> None:
        # A dropped pool's unconfirmed store saves leave the store index.
        for w in self.workers:
            w.pool.drop_store_pending()
        assert not self.store.lru.pending


TiersMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiers_machine = TiersMachine.TestCase
