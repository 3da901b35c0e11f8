"""Reads: one pool's (block tables, stats, dumps) and across pools
(MatchPrefix, ListPools, the metrics' views, a WatchEvents snapshot).

Each pool is read under its own lock, one at a time, so a read waits for
one pool's step at most and holds up no other pool; figures read without a
lock (free blocks, the store's) are load figures, not promises.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple

from allocator_service.config import Limits
from allocator_service.core import PoolStats, snapshot
from allocator_service.core.hashing import prompt_chain
from allocator_service.core.tier_index import StoreStats, TierStats
from allocator_service.core.validation import check_cache_salt, check_tokens
from allocator_service.service.changes import Changes, PoolRef
from allocator_service.store.registry import PoolEntry
from allocator_service.wire.attest import attest_key
from allocator_service.wire.bounds import DUMP_FRAME_BYTES, dump_floor
from allocator_service.wire.codec import PoolInfo, PrefixMatch
from allocator_service.wire.errors import AnswerTooLarge, BadRequest


class PoolReport(NamedTuple):
    """A pool's stats as GetPoolStats answers them."""

    stats: PoolStats
    last_step_id: int
    integrity_problems: list[str]
    integrity_checked: bool


class TierView(NamedTuple):
    """One pool's KV tiers as ListPools and the metrics read them."""

    host_blocks: int  # host tier slots (0: none)
    host_used_blocks: int  # holding an entry, pending or present
    use_shared_store: bool
    store_used_bytes: int  # the shared store's, every pool's entries
    block_bytes: int
    stats: TierStats  # a copy


NO_TIERS = TierView(0, 0, False, 0, 0, TierStats())


class StoreView(NamedTuple):
    """The shared store's figures as the metrics read them."""

    capacity_bytes: int
    used_bytes: int
    entries: int  # pending ones included
    pending: int
    stats: StoreStats  # a copy


class Reads:
    """What the pools hold, read without changing them."""

    def __init__(self, changes: Changes, limits: Limits) -> None:
        self.changes = changes
        self.limits = limits

    # ------------------------------------------------------------ one pool
    def block_table(self, ref: PoolRef, seq_id: str) -> tuple[list[int], int]:
        entry = self.changes.authorize(ref)
        with entry.lock:
            return entry.pool.block_table(seq_id), entry.pool.num_tokens(seq_id)

    def stats(self, ref: PoolRef, check_integrity: bool = False, admin: bool = False) -> PoolReport:
        entry = self.changes.authorize(ref, admin)
        with entry.lock:
            problems = entry.pool.integrity_problems() if check_integrity else []
            stats, last = entry.pool.stats(), entry.last_step_id
        return PoolReport(stats, last, problems, check_integrity)

    def dump(self, ref: PoolRef, admin: bool = False) -> tuple[str, int, list[str]]:
        """The pool's full dump as JSON text, its last step id and its
        integrity problems. A dump larger than an answer may be is refused
        (AnswerTooLarge); one that certainly is (`dump_floor`, counted under
        the lock) is refused before it is built."""
        entry = self.changes.authorize(ref, admin)
        limit = self.limits.max_message_bytes
        with entry.lock:
            floor = dump_floor(entry.pool)
            if floor > limit:
                raise AnswerTooLarge(self._dump_refusal(ref, floor, limit, "at least "))
            state, last_step_id = entry.pool.to_state(), entry.last_step_id
            problems = entry.pool.integrity_problems()
        text = snapshot.dumps_chunked(state)  # outside the lock: the pool's steps go on
        if len(text) + DUMP_FRAME_BYTES > limit:
            raise AnswerTooLarge(self._dump_refusal(ref, len(text), limit, ""))
        return text, last_step_id, problems

    @staticmethod
    def _dump_refusal(ref: PoolRef, size: int, limit: int, how: str) -> str:
        return (
            f"pool {ref.pool_id}'s dump takes {how}{size:,} bytes, more than the {limit:,} an "
            "answer may: read its block tables with GetBlockTable, or its stats and integrity "
            "with GetPoolStats"
        )

    # ---------------------------------------------------------- every pool
    def match_prefix(
        self, fingerprint: str, tokens: list[int], salt: str | None
    ) -> list[PrefixMatch]:
        """Which pools hold how much of the prompt. The prompt's hash chain is
        computed once per block size, outside any lock; each pool is then
        visited under its own lock for lookups only."""
        if len(tokens) > self.limits.max_tokens_per_call:
            raise BadRequest(
                f"{len(tokens)} tokens; the limit is {self.limits.max_tokens_per_call}"
            )
        check_cache_salt(salt)
        pools = [
            e
            for e in list(self.changes.registry.pools.values())
            if e.pool.config.model_fingerprint == fingerprint
        ]
        if len(tokens) >= 2 and any(e.pool.enable_prefix_caching for e in pools):
            check_tokens(tokens)
        chains: dict[int, list[bytes]] = {}
        out = []
        for e in pools:
            pool = e.pool
            cached = host = store = 0
            if pool.enable_prefix_caching and len(tokens) >= 2:
                size = pool.block_size
                hashes = chains.get(size)
                if hashes is None:
                    hashes = chains[size] = prompt_chain(fingerprint, tokens, size, salt)
                # NOTE: the store's index is read without the mutation lock
                # (lookups only): a figure as of some moment of this call.
                with e.lock:
                    cached, host, store = pool.tier_blocks(hashes)
                cached, host, store = cached * size, host * size, store * size
            out.append(
                PrefixMatch(
                    e.pool_id,
                    e.worker_id,
                    cached,
                    pool.num_free_blocks,
                    pool.block_size,
                    host,
                    store,
                )
            )
        out.sort(key=lambda m: (-m.cached_tokens, -m.free_blocks, m.pool_id))
        return out

    def list_pools(self, fingerprint: str = "") -> list[PoolInfo]:
        """Every live pool (of `fingerprint`, when given), by pool id: what a
        router needs to reach its worker and weigh its load. Each pool is
        read under its own lock."""
        out = []
        for e in sorted(list(self.changes.registry.pools.values()), key=lambda e: e.pool_id):
            config = e.pool.config
            if fingerprint and config.model_fingerprint != fingerprint:
                continue
            with e.lock:
                s, t = e.pool.stats(), self._tier_view(e)
            out.append(
                PoolInfo(
                    e.pool_id,
                    e.worker_id,
                    config.model_fingerprint,
                    e.served_model_name,
                    e.advertise_url,
                    s.block_size,
                    s.num_blocks,
                    s.free_blocks,
                    s.used_blocks,
                    s.cached_blocks,
                    s.num_sequences,
                    e.pool.enable_prefix_caching,
                    attest_key(e.credential_digest),
                    t.host_blocks,
                    t.host_used_blocks,
                    t.use_shared_store,
                    t.store_used_bytes,
                    t.stats.host_hit_tokens,
                    t.stats.store_hit_tokens,
                    config.kv_role,
                    config.store_namespace,
                )
            )
        return out

    @staticmethod
    def _tier_view(e: PoolEntry) -> TierView:
        """A pool's tiers as the listing and the metrics read them (its lock held)."""
        tiers = e.pool.tiers
        if tiers is None:
            return NO_TIERS
        host = tiers.host
        store = tiers.store
        return TierView(
            host.lru.capacity if host is not None else 0,
            len(host.lru) if host is not None else 0,
            store is not None,
            store.lru.used if store is not None else 0,
            e.pool.config.block_bytes,
            replace(tiers.stats),
        )

    def tier_stats(self) -> list[tuple[str, str, TierView]]:
        """(pool id, worker id, its tiers) of every live pool with KV tiers,
        each read under its own lock: what the metrics collector reads."""
        out = []
        for e in list(self.changes.registry.pools.values()):
            if e.pool.tiers is not None:
                with e.lock:
                    out.append((e.pool_id, e.worker_id, self._tier_view(e)))
        return out

    def store_stats(self) -> StoreView | None:
        """The shared store's figures (None: no store), read without the
        mutation lock: a figure."""
        store = self.changes.registry.store
        if store is None:
            return None
        return StoreView(
            store.capacity_bytes,
            store.lru.used,
            len(store.lru),
            len(store.lru.pending),
            replace(store.stats),
        )

    def free_blocks(self, pool_id: str) -> int | None:
        """A live pool's free blocks (None: no such pool), read without its
        lock as MatchPrefix reads them: a load figure, not a promise."""
        entry = self.changes.registry.pools.get(pool_id)
        return entry.pool.num_free_blocks if entry is not None else None

    def cached_blocks(self, chunk: int) -> Iterator[tuple[str, list[int], list[bytes]]]:
        """(pool id, blocks, their hashes), at most `chunk` blocks each, for
        every live pool's cached blocks: the start of a WatchEvents snapshot.
        Each piece is read under the pool's lock, let go between pieces, so a
        Step waits for one piece at most; the events numbered from before the
        call, replayed onto the pieces, make the view exact (why:
        docs/architecture.md, "The router's rules, and why")."""
        registry = self.changes.registry
        for e in list(registry.pools.values()):
            hashes = e.pool.index.block_hash
            for lo in range(0, len(hashes), chunk):
                with e.lock:
                    if self.changes.registry.pools.get(e.pool_id) is not e:
                        break  # dropped meanwhile (its POOL_DROPPED event follows)
                    part = hashes[lo : lo + chunk]
                ids = [b for b, h in enumerate(part, lo) if h is not None]
                if ids:
                    yield e.pool_id, ids, [h for h in part if h is not None]

    def pool_stats(self) -> list[tuple[str, str, PoolStats]]:
        """(pool id, worker id, stats) of every live pool, each read under its
        own lock: what the metrics collector reads."""
        out = []
        for e in list(self.changes.registry.pools.values()):
            with e.lock:
                out.append((e.pool_id, e.worker_id, e.pool.stats()))
        return out
