"""The worker's side of the shared store (tier 2): KV blocks to the store by block
hash, and entries back into KV blocks.

Every call answers per block and never raises for the store's sake: a store that
stops answering makes its loads misses (`unavailable`) and its saves failures (the
allocator then never indexes them), logs one warning per outage, and counts each
failed call in the meter. While it is down, calls skip it for `retry_interval_s`
between tries, so a step does not wait on a dead host every time. A peer store's
loads name their writers (`load_blocks(sources=...)`): each writer is asked apart,
all of a step's pulls within the store's `pull_timeout_s` (the engine thread waits
for them, so every running sequence does), and one that does not answer in time
makes its own loads misses, not the others', and is skipped the same way for
`retry_interval_s`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from worker.kv_pool import KVPool
from worker.tiers.blocks import check_ids, gather, scatter
from worker.tiers.entry import REFUSAL_REASONS, Refused, decode_entry, encode_entry, entry_key
from worker.tiers.host import HostMemory
from worker.tiers.layout import KVLayout
from worker.tiers.meter import TierMeter
from worker.tiers.seal import StoreSeal
from worker.tiers.store import KVStore, PullTimeSpent, StoreError

__all__ = ["LoadOutcome", "StoreMover"]

log = logging.getLogger("worker.tiers")


class LoadOutcome(NamedTuple):
    """What became of one store load: `loaded`, or `reason` it was not:
    `missing` (no entry under the key), `unavailable` (the store did not answer),
    or a refusal (`format`, `layout`, `checksum`, `seal`: found, not loaded).
    Every load not loaded but `unavailable` is counted by its reason and
    reported `refused` to the allocator (its entry is dropped)."""

    loaded: bool
    reason: str | None = None

    @property
    def refused(self) -> bool:
        return self.reason in REFUSAL_REASONS


LOADED = LoadOutcome(True)
MISSING = LoadOutcome(False, "missing")
UNAVAILABLE = LoadOutcome(False, "unavailable")
_NO_ANSWER = object()  # a pulled entry whose writer did not answer


class StoreMover:
    """Moves one worker's blocks between its KV pool and a shared store, under the
    pool's store `namespace` (the allocator's `store_namespace`; the layout key when
    ""), sealing what it writes and opening what it reads with its group's `seal`
    (None: plain entries, `entry.py`)."""

    def __init__(
        self,
        store: KVStore,
        layout: KVLayout,
        pool: KVPool,
        *,
        namespace: str = "",
        seal: StoreSeal | None = None,
        host: HostMemory | None = None,
        meter: TierMeter | None = None,
        retry_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        layout.check_pool(pool)
        if host is not None and host.pool is not pool:
            raise ValueError("the host tier belongs to another KV pool")
        self.store = store
        self.layout = layout
        self.namespace = namespace or layout.key
        self.seal = seal
        self.pool = pool
        self.host = host
        self._meter = meter
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._writers_down: dict[str, float] = {}  # a peer store's: writer -> when to ask again

    @property
    def available(self) -> bool:
        """False from a failed store call until one succeeds again."""
        return self._down_since is None

    # -- saves ------------------------------------------------------------------

    def save_blocks(self, kv_blocks: Sequence[int], hashes: Sequence[bytes]) -> list[bool]:
        """Write KV blocks `kv_blocks[i]` as the entries of `hashes[i]`; per block, whether
        its bytes are in the store."""
        self._check_pairs(kv_blocks, hashes)
        check_ids("KV block", kv_blocks, self.pool.num_blocks, distinct=False)
        return self._save(kv_blocks, hashes) if kv_blocks else []

    def _save(self, kv_blocks: Sequence[int], hashes: Sequence[bytes]) -> list[bool]:
        """The bytes of checked, non-empty saves to the store."""
        if not self._may_try():
            return [False] * len(kv_blocks)
        t0 = time.perf_counter()
        rows = gather(self.pool, kv_blocks).cpu().view(len(kv_blocks), -1).view(torch.uint8).numpy()
        return self._put(hashes, [memoryview(row) for row in rows], t0)

    def delete(self, hashes: Sequence[bytes], layouts: Sequence[str] | None = None) -> bool:
        """Remove the entries of `hashes` (of this mover's namespace, or of namespace
        `layouts[i]`: the store's LRU drops any pool's entries), best effort (the
        allocator's index already dropped them); whether the store did."""
        if not hashes or not self._may_try():
            return False
        keys = (
            [entry_key(self.namespace, h) for h in hashes]
            if layouts is None
            else [entry_key(lay, h) for lay, h in zip(layouts, hashes, strict=True)]
        )
        try:
            self.store.delete_many(keys)
        except StoreError as exc:
            self._failed(exc)
            return False
        self._answered()
        return True

    # -- loads ------------------------------------------------------------------

    def load_blocks(
        self,
        hashes: Sequence[bytes],
        kv_blocks: Sequence[int],
        sources: Sequence[str] | None = None,
    ) -> list[LoadOutcome]:
        """Read the entries of `hashes` into KV blocks `kv_blocks[i]` (distinct); per block,
        whether it was loaded. A block not loaded is untouched: its tokens are computed.
        `sources`: a peer store's, each entry's writer (`TierMoves.store_load_from`)."""
        self._check_pairs(kv_blocks, hashes)
        check_ids("KV block", kv_blocks, self.pool.num_blocks, distinct=True)
        if sources and len(sources) != len(hashes):
            raise ValueError(f"{len(hashes)} loads but {len(sources)} sources")
        return self._load(hashes, kv_blocks, sources) if kv_blocks else []

    def _load(
        self,
        hashes: Sequence[bytes],
        kv_blocks: Sequence[int],
        sources: Sequence[str] | None = None,
    ) -> list[LoadOutcome]:
        """The bytes of checked, non-empty loads from the store."""
        t0 = time.perf_counter()
        keys = [entry_key(self.namespace, h) for h in hashes]
        if sources:
            found = self._pull(keys, sources)
        else:
            if not self._may_try():
                return [UNAVAILABLE] * len(kv_blocks)
            try:
                found = self.store.get_many(keys)
            except StoreError as exc:
                self._failed(exc)
                return [UNAVAILABLE] * len(kv_blocks)
            self._answered()
        outcomes: list[LoadOutcome] = []
        payloads: list[memoryview] = []
        targets: list[int] = []
        for h, block, data in zip(hashes, kv_blocks, found, strict=True):
            if data is _NO_ANSWER:
                outcomes.append(UNAVAILABLE)
                continue
            if data is None:
                if self._meter is not None:
                    self._meter.refused("missing")
                outcomes.append(MISSING)
                continue
            payload = decode_entry(data, self.layout, h, seal=self.seal, namespace=self.namespace)
            if isinstance(payload, Refused):
                log.warning(
                    "shared store %s: entry of block %s refused (%s: %s)",
                    self.store.url,
                    h.hex()[:12],
                    payload.reason,
                    payload.detail,
                )
                if self._meter is not None:
                    self._meter.refused(payload.reason)
                outcomes.append(LoadOutcome(False, payload.reason))
                continue
            payloads.append(payload)
            targets.append(block)
            outcomes.append(LOADED)
        if targets:
            stage = np.empty((len(targets), self.layout.block_bytes), dtype=np.uint8)
            for i, payload in enumerate(payloads):
                stage[i] = np.frombuffer(payload, dtype=np.uint8)
            data = (
                torch.from_numpy(stage)
                .view(self.pool.dtype)
                .view(len(targets), *self.layout.block_shape)
            )
            if self.host is not None:
                self.host.wait()  # a block loaded into may be one a host save is still reading
            scatter(self.pool, targets, data.to(self.pool.device))
            if self._meter is not None:
                self._meter.loaded(
                    len(targets), len(targets) * self.layout.block_bytes, time.perf_counter() - t0
                )
        return outcomes

    # -- inside -----------------------------------------------------------------

    def _pull(self, keys: Sequence[str], sources: Sequence[str]) -> list:
        """A peer store's entries of `keys`, one call per writer `sources[i]`, all
        by the store's pull deadline: per key its bytes, None (the writer does not
        hold it) or `_NO_ANSWER` (no answer in time, or not asked: it did not
        answer lately, or the step's pull time was spent before its turn)."""
        found: list = [None] * len(keys)
        by_source: dict[str, list[int]] = {}
        for i, source in enumerate(sources):
            by_source.setdefault(source, []).append(i)
        deadline = time.monotonic() + self.store.pull_timeout_s  # type: ignore[attr-defined]
        for source, at in by_source.items():
            got = [_NO_ANSWER] * len(at)
            if self._clock() >= self._writers_down.get(source, 0.0):
                try:
                    got = self.store.fetch(source, [keys[i] for i in at], deadline)  # type: ignore[attr-defined]
                    self._writers_down.pop(source, None)
                except PullTimeSpent:
                    pass  # the writers before it took the time: asked next step
                except StoreError as exc:
                    self._writer_failed(source, len(at), exc)
            for i, data in zip(at, got, strict=True):
                found[i] = data
        return found

    def _writer_failed(self, source: str, loads: int, exc: StoreError) -> None:
        """A peer store's writer did not answer in time: it may be gone or slow, its
        entries may still be fine; its loads are misses now, and it is not asked
        again for `retry_interval_s`."""
        if self._meter is not None:
            self._meter.store_error()
        log.warning(
            "shared store peer://: %d loads are misses, the writer is not asked for %g s: %s",
            loads,
            self._retry_interval_s,
            exc,
        )
        now = self._clock()
        down = self._writers_down
        for writer in [w for w, again in down.items() if again <= now]:  # asked again already
            del down[writer]
        down[source] = now + self._retry_interval_s

    def _put(
        self, hashes: Sequence[bytes], payloads: Sequence[memoryview], t0: float
    ) -> list[bool]:
        items = [
            (
                entry_key(self.namespace, h),
                encode_entry(self.layout, h, p, seal=self.seal, namespace=self.namespace),
            )
            for h, p in zip(hashes, payloads, strict=True)
        ]
        try:
            self.store.put_many(items)
        except StoreError as exc:
            self._failed(exc)
            return [False] * len(items)
        self._answered()
        if self._meter is not None:
            self._meter.saved(
                len(items), len(items) * self.layout.block_bytes, time.perf_counter() - t0
            )
        return [True] * len(items)

    @staticmethod
    def _check_pairs(ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        if len(ids) != len(hashes):
            raise ValueError(f"{len(ids)} blocks but {len(hashes)} hashes")

    def _may_try(self) -> bool:
        return self._down_since is None or self._clock() >= self._retry_at

    def _failed(self, exc: StoreError) -> None:
        if self._meter is not None:
            self._meter.store_error()
        now = self._clock()
        if self._down_since is None:
            self._down_since = now
            log.warning("shared store unreachable, its blocks are misses until it answers: %s", exc)
        self._retry_at = now + self._retry_interval_s

    def _answered(self) -> None:
        if self._down_since is not None:
            log.warning(
                "shared store %s answers again after %.1f s",
                self.store.url,
                self._clock() - self._down_since,
            )
            self._down_since = None
