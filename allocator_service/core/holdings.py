"""What a block pool holds: its containers, the reads over them and their
round trip (parts, dumps, integrity checks). `BlockPool` (pool.py) adds
every change; nothing here changes a block."""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from itertools import islice
from typing import Any, Self

from mypy_extensions import mypyc_attr

from allocator_service.core import hashing, integrity, snapshot
from allocator_service.core.block_ids import block_ids, shared
from allocator_service.core.errors import InvalidArgument, UnknownSequence
from allocator_service.core.limits import max_name_chars, max_sequences, max_table_entries
from allocator_service.core.prefix_index import EventSink, PrefixIndex
from allocator_service.core.sequence import SeqEntry
from allocator_service.core.state import PoolConfig, PoolParts, PoolStats
from allocator_service.core.tier_index import SharedStore
from allocator_service.core.tiers import PoolTiers
from allocator_service.core.validation import check_cache_salt, check_tokens

# The counters `stats()` reports, kept in a dump.
_COUNTERS = ("prefix_queried_tokens", "prefix_hit_tokens", "evictions", "copies", "out_of_blocks")


@mypyc_attr(allow_interpreted_subclasses=True)
class PoolHoldings:
    """A pool's blocks, tables, refcounts, prefix index and tiers, read
    (`stats`, tables, prefix lookups), dumped and checked. Pure Python,
    single-threaded: callers serialise access."""

    def __init__(
        self,
        config: PoolConfig,
        event_sink: EventSink | None = None,
        store: SharedStore | None = None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.enable_prefix_caching = config.enable_prefix_caching
        self.root_hash = hashing.root_hash(config.model_fingerprint, config.block_size)

        n = config.num_blocks
        # NOTE: lists, not arrays: an array would take 4 or 2 bytes a block
        # instead of 8, but each access boxes an int, and a free or an append
        # reads and writes these once a block (~25 ns more each).
        self.ref_cnt: list[int] = [0] * n
        self._fill: list[int] = [0] * n
        self.index = PrefixIndex(n, event_sink)
        # Every block id these hold is an object of the list all pools share.
        self._ids = block_ids(n)
        # The free queue's front: ids `_fresh` to n-1, never handed out yet
        # (a fresh pool hands out 0, 1, 2, ...), kept as that range instead of
        # n entries of the deque; the blocks freed since follow in the deque.
        self._fresh = 0
        self._uncached_free: deque[int] = deque()
        # NOTE: an OrderedDict is the doubly linked list that lets a cache hit
        # pull a block out of the middle of the evictable queue in O(1).
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        # When several blocks hold one hash, a hit prefers one in use, else the
        # free one evicted last: `_stamp` records when a block joined the queue
        # (an array: a list would hold an int object of 28 bytes per stamp).
        self._stamp: array[int] = array("q", [0]) * n
        self._clock = 0
        self._seqs: dict[str, SeqEntry] = {}
        # The bounded cost of a pool (limits.py): table entries summed over
        # every sequence, kept exact by admit/append/fork/free.
        self.max_sequences = max_sequences(n)
        self.max_table_entries = max_table_entries(n)
        self.table_entries = 0
        # ... and characters of sequence ids plus salts (`pool._name_chars`).
        self.max_name_chars = max_name_chars(n)
        self.name_chars = 0

        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.evictions = 0
        self.copies = 0
        self.out_of_blocks = 0

        self.tiers: PoolTiers | None = None
        if config.tiered:
            if config.use_shared_store and store is None:
                raise InvalidArgument("the pool uses the shared store, and none was given")
            self.tiers = PoolTiers(
                config.host_blocks,
                store if config.use_shared_store else None,
                config.store_namespace,
                config.block_bytes,
            )

    # ------------------------------------------------------------------ reads
    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._fresh + len(self._uncached_free) + len(self._cached_free)

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._get(seq_id).table)

    def num_tokens(self, seq_id: str) -> int:
        return self._get(seq_id).num_tokens

    def tables(self) -> dict[str, list[int]]:
        return {s: list(q.table) for s, q in self._seqs.items()}

    def free_order(self) -> list[int]:
        """The order in which free blocks would be handed out, first first."""
        return [*self._uncached(), *self._cached_free]

    def refcounts(self) -> dict[int, int]:
        return {b: c for b, c in enumerate(self.ref_cnt) if c > 0}

    def stats(self) -> PoolStats:
        free = self.num_free_blocks
        used = self.num_blocks - free
        stored = sum(f for f, r in zip(self._fill, self.ref_cnt, strict=True) if r > 0)
        return PoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            used_blocks=used,
            cached_blocks=len(self._cached_free),
            free_blocks=free,
            num_sequences=len(self._seqs),
            tokens_stored=stored,
            slots_allocated=used * self.block_size,
            prefix_queried_tokens=self.prefix_queried_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            evictions=self.evictions,
            copies=self.copies,
            out_of_blocks=self.out_of_blocks,
        )

    def cached_prefix_tokens(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of `tokens` an admit would find cached
        (read-only; what a router asks). Never counts the last token."""
        check_cache_salt(cache_salt)
        if not self.enable_prefix_caching or len(tokens) < 2:
            return 0
        check_tokens(tokens)
        limit = (len(tokens) - 1) // self.block_size
        parent = self.root_hash
        keys = hashing.salt_keys(cache_salt)
        hits = 0
        B = self.block_size
        for i in range(limit):  # hashes only as far as the first miss
            parent = hashing.block_hash(parent, tokens[i * B : (i + 1) * B], keys if i == 0 else ())
            if parent not in self.index:
                break
            hits += 1
        return hits * B

    def cached_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes` (a prompt's chain from this pool's root, its
        last token's block left out), from the first, are cached: lookups
        only, so a caller can hash a prompt once, outside the pool's lock,
        for every pool of one root (what `cached_prefix_tokens` answers)."""
        if not self.enable_prefix_caching:
            return 0
        return self.index.leading_hits(hashes)

    def tier_blocks(self, hashes: Sequence[bytes]) -> tuple[int, int, int]:
        """How many of `hashes` (a prompt's chain, as `cached_blocks` takes)
        an admit would find, from the first, in (the KV pool, the host
        tier, the store), by the admission's rule: each block in the KV
        pool, else the host tier, else the store."""
        tiers = self.tiers
        if tiers is None:
            return self.cached_blocks(hashes), 0, 0
        found = [0, 0, 0]
        index = self.index
        for h in hashes:
            if h in index:
                found[0] += 1
            elif (t := tiers.find(h)) is not None:
                found[t] += 1
            else:
                break
        return found[0], found[1], found[2]

    # -------------------------------------------------------------- internals
    def _get(self, seq_id: str) -> SeqEntry:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(seq_id)
        return seq

    def _uncached(self) -> list[int]:
        """The uncached free blocks in hand-out order: the ids never handed
        out, then the deque."""
        return [*islice(self._ids, self._fresh, self.num_blocks), *self._uncached_free]

    # ---------------------------------------- checks and dumps (own modules)
    def parts(self) -> PoolParts:
        """The pool's containers as they are, read only (no copies but the
        uncached free queue's list: the ids never handed out, then the deque)."""
        return PoolParts(
            self.ref_cnt,
            self._fill,
            self.index.block_hash,
            self._uncached(),
            self._cached_free,
            self._stamp,
            self._clock,
            self._seqs,
        )

    @classmethod
    def from_parts(
        cls,
        config: PoolConfig,
        parts: PoolParts,
        counters: Mapping[str, int],
        event_sink: EventSink | None = None,
        store: SharedStore | None = None,
    ) -> Self:
        """A pool holding `parts` (its lists taken over, not copied; each
        sequence keeps apart only the hashes of its chain that its blocks do
        not hold) and the `stats()` counters given in `counters`
        (prefix_queried_tokens, ...); its tiers empty (`from_state` restores
        them)."""
        pool = cls(config, event_sink, store)
        pool.ref_cnt = parts.ref_cnt
        pool._fill = parts.fill
        pool.index = PrefixIndex.over(parts.block_hash, event_sink)
        ids = pool._ids
        pool._fresh = pool.num_blocks
        pool._uncached_free = deque(shared(ids, parts.uncached_free))
        pool._cached_free = OrderedDict.fromkeys(shared(ids, parts.cached_free))
        pool._stamp = array("q", parts.stamp)
        pool._clock = parts.clock
        pool._seqs = dict(parts.seqs)
        for q in pool._seqs.values():
            q.table = shared(ids, q.table)
            q.compact(parts.block_hash)
        pool.table_entries = sum(len(q.table) for q in pool._seqs.values())
        pool.name_chars = sum(len(s) + len(q.salt or "") for s, q in pool._seqs.items())
        for name, value in counters.items():
            if name in _COUNTERS:  # one a dump lacks stays 0
                setattr(pool, name, value)
        return pool

    def integrity_problems(self) -> list[str]:
        """Every broken invariant, as a readable line (empty when sound)."""
        return integrity.integrity_problems(self)

    def check_integrity(self) -> bool:
        return not self.integrity_problems()

    def to_state(self) -> dict[str, Any]:
        """A JSON-able dump of the whole state, its tiers included (taken
        between steps: moves not yet taken are not in it); `from_state`
        rebuilds it exactly. The shared store dumps itself (`SharedStore`)."""
        return snapshot.to_state(self)

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        event_sink: EventSink | None = None,
        store: SharedStore | None = None,
    ) -> Self:
        """The pool `state` dumps (the shared store it uses, restored from
        its own dump, is given as at construction)."""
        parts, counters = snapshot.parts_of(state)
        pool = cls.from_parts(
            PoolConfig(**state["config"]), PoolParts(*parts), counters, event_sink, store
        )
        if pool.tiers is not None:
            pool.tiers.restore(state["tiers"])
        return pool
