"""The KV tiers in the engine: the allocator's tier moves applied around the
forward pass, and their outcome reported in a later step.

- A step's moves ride its `StepBatch` (`moves`) and `apply_tiers` applies them
  when the batch computes, before its forward pass writes anything, in the
  order store deletes, store saves, host saves, copy-on-write copies, loads.
- Done: a host save when `HostMemory.save` returns (CPU), when its transfer's
  event is done (CUDA, polled by `take_report`) or when the device stream has
  done it (`sim:`); a store save or load at once. `take_report` hands what is
  done to the next allocator call.
- A store load not loaded is computed by the same forward pass: every entry
  whose computed prefix holds that block computes from it on, those tokens are
  not counted as cached (`_recompute`), and the hash is reported `refused`
  unless the store did not answer.
- Swap: half of the host tier's slots are the worker's (`swap_slots_for`). A
  preempted sequence keeps the K/V of its last blocks there (all that fit, if
  they include every block the allocator cannot find; else none); at resume
  those past what the admission found are copied back, and a resume that found
  less than where they start recomputes from what it found.

The reasons: docs/architecture.md, "Tiers".
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from allocator_service.client import AllocatorClient
from allocator_service.core import blocks_for
from allocator_service.core.tiers import Moves, TierReport
from worker.engine.step_plan import StepBatch
from worker.kv_pool import KVPool
from worker.metrics import TierMetrics, WorkerMetrics
from worker.tiers import (
    HostMemory,
    KVLayout,
    PeerStore,
    StoreMover,
    StoreSeal,
    Transfer,
    open_store,
)

__all__ = ["EngineTiers", "SwapStash", "swap_slots_for"]

log = logging.getLogger("pagedkv.worker")


class SwapStash(NamedTuple):
    """A preempted sequence's tail in swap slots: slot i holds the block of
    token positions `start + i * block_size ...`; K/V of positions up to `end`."""

    slots: list[int]
    start: int  # a block boundary: the first position the allocator cannot find
    end: int  # positions [start, end) hold computed K/V


def swap_slots_for(host_slots: int) -> int:
    """Host slots kept for swapped-out sequences in swap mode: half of the host tier."""
    return host_slots // 2


class EngineTiers:
    """One worker's tiers below its KV pool: its host tier (or None), its
    store mover (`open_store`, or None), the swap slots, and the report of
    moves done not yet sent."""

    def __init__(
        self,
        pool: KVPool,
        layout: KVLayout,
        host: HostMemory | None,
        metrics: WorkerMetrics,
        *,
        swap_slots: int = 0,
        store_mover: Callable[..., StoreMover] = StoreMover,
    ) -> None:
        self.pool = pool
        # the runner's: StoreMover, or a simulated device's TimedStoreMover
        self._store_mover = store_mover
        self.layout = layout
        self.block_size = pool.block_size
        self.host = host
        self.metrics = metrics
        self.store: StoreMover | None = None
        self._store_key: bytes | None = None
        self._peer: dict[str, object] = {}
        n = host.num_slots if host is not None else 0
        if swap_slots and (host is None or not 0 < swap_slots < n):
            raise ValueError(f"{swap_slots} swap slots do not fit a host tier of {n} slots")
        # The allocator's part of the host tier (slots
        # 0..host_blocks-1); the rest is the swap stash's.
        self.host_blocks = n - swap_slots
        self.swapping = swap_slots > 0
        self._swap_free: deque[int] = deque(range(self.host_blocks, n))
        self._host_meter: TierMetrics | None = metrics.tier("host") if host is not None else None
        self._store_meter: TierMetrics | None = None
        self._report: TierReport = TierReport([], [], [], [], [])
        self._saving: deque[tuple[Transfer, list[int]]] = deque()  # host saves in flight (CUDA)
        self._written: set[int] = set()  # host slots of the allocator's part holding saved bytes

    def open_store(
        self, url: str, namespace: str = "", key: bytes | None = None, **peer: object
    ) -> None:
        """Use the shared store at `url` (StoreOpenError, one line, when it cannot be used),
        its entries under `namespace` (the allocator's), sealed with the store group's `key`.
        `peer`: a peer store's `own_url`, `peer_key`, `capacity` and `pull_timeout_s`
        (`open_store`)."""
        self._store_key, self._peer = key, peer
        self._store_meter = self.metrics.tier("shared")
        store = open_store(url, **peer)  # type: ignore[arg-type]
        if isinstance(store, PeerStore):  # what this worker holds of it is its memory
            store.on_served = self._store_meter.served
            self._store_meter.set_capacity(store.capacity_bytes)
            self._store_meter.set_used(store.used_bytes)
        self.store = self._store_mover(
            store,
            self.layout,
            self.pool,
            namespace=namespace,
            seal=StoreSeal(key) if key is not None else None,
            host=self.host,
            meter=self._store_meter,
        )

    # ------------------------------------------------------------ the report
    def take_report(self) -> TierReport | None:
        """What the moves applied so far became (since the last call): for
        the next allocator call. None when nothing."""
        saving = self._saving
        while saving and saving[0][0].done():
            self._report.saved.extend(saving.popleft()[1])
        if self.host is not None:
            self.host.poll()
        report = self._report
        if not any(report):
            return None
        self._report = TierReport([], [], [], [], [])
        return report

    def report_due(self) -> bool:
        """Whether moves applied are done and not reported yet: the engine
        steps to report them even with nothing else to send (a save is found
        by other workers only once reported)."""
        return any(self._report) or bool(self._saving and self._saving[0][0].done())

    def give_back(self, report: TierReport | None) -> None:
        """The call that carried `report` was refused (it
        applied nothing): it rides the next one."""
        if report is None:
            return
        for mine, theirs in zip(self._report, report, strict=True):
            mine[:0] = theirs

    def pool_lost(self, allocator: AllocatorClient) -> None:
        """The allocator dropped the pool: a report names the old pool's moves, so none goes out.
        The fresh pool uses the store `allocator` names now (its `shared_store`, namespace and
        peer key): an allocator restarted on another store drops the pools of the old one, whose
        workers must not write there any more."""
        shared_store, namespace = allocator.shared_store, allocator.store_namespace
        peer_key = allocator.peer_key
        self._report = TierReport([], [], [], [], [])
        self._saving.clear()
        self._written.clear()
        self._set_used()
        mover = self.store
        if mover is not None and isinstance(mover.store, PeerStore) and peer_key:
            mover.store.peer_key = peer_key  # the allocator's, for the fresh pool's group
        now = (mover.store.url, mover.namespace) if mover is not None else None
        if mover is None or now == (shared_store, namespace or self.layout.key):
            return  # (a worker that opted out of the store, or the same store)
        self.store = None
        mover.store.close()
        if shared_store:
            try:
                self.open_store(shared_store, namespace, self._store_key, **self._peer)
            except ValueError as exc:
                # the new store cannot be used here: no store, not a dead worker
                log.warning(
                    "the allocator's shared store changed to one this worker cannot use: %s", exc
                )
        log.warning("shared store: %s now (was %s)", shared_store or "none", now[0])

    # ------------------------------------------------------------- the moves
    def apply(self, batch: StepBatch, copy_blocks) -> None:
        """Apply `batch`'s tier moves and copy-on-write copies (`copy_blocks`)
        in their order, before its forward pass (the module docstring)."""
        host, store, report = self.host, self.store, self._report
        for blocks, slots in batch.swap_out:  # before anything of this step writes a block
            host.save(blocks, slots)  # type: ignore[union-attr]
        m = batch.moves
        if m is not None:
            if m.store_deletes and store is not None:
                store.delete(m.store_deletes, m.store_delete_layouts)
            if m.store_saves:
                self._store_saves(m)
            if (m.store_deletes or m.store_saves) and isinstance(
                getattr(store, "store", None), PeerStore
            ):
                self._store_meter.set_used(store.store.used_bytes)  # type: ignore[union-attr]
            if m.host_saves:
                self._host_saves(m.host_saves[0::2], m.host_saves[1::2])
        if batch.copies:
            if host is not None:
                host.wait()  # a copy may write a block a host save reads
            copy_blocks(batch.copies)
        if m is not None and (m.host_loads or m.store_loads):
            host_to = m.host_loads[1::2]
            if host_to:
                host.load(m.host_loads[0::2], host_to)  # type: ignore[union-attr]
            store_to: list[int] = []
            if m.store_loads:
                missed = self._store_loads(m, report)
                store_to = [b for b in m.store_load_to if b not in missed]
                if missed:
                    self._recompute(batch, missed)
            self._count_hits(batch, host_to, store_to)
        for slots, blocks in batch.swap_in:
            host.load(slots, blocks)  # type: ignore[union-attr]
        if host is not None:
            host.wait()  # the forward pass reads loaded blocks and writes saved ones
            self._set_used()

    def _store_saves(self, m: Moves) -> None:
        store, hashes, src = self.store, m.store_saves, m.store_save_from
        ok = [False] * len(hashes) if store is None else store.save_blocks(src, hashes)
        for h, good in zip(hashes, ok, strict=True):
            (self._report.store_saved if good else self._report.store_failed).append(h)

    def _host_saves(self, kv_blocks: list[int], slots: list[int]) -> None:
        try:
            transfer = self.host.save(kv_blocks, slots)  # type: ignore[union-attr]
        except (ValueError, RuntimeError) as exc:
            # ids out of range, a copy that failed: the saves failed
            log.warning("host tier: %d saves failed: %s", len(slots), exc)
            self._report.failed.extend(slots)
            return
        self._written.update(slots)
        if transfer.done():
            self._report.saved.extend(slots)
        else:
            self._saving.append((transfer, list(slots)))

    def _store_loads(self, m: Moves, report: TierReport) -> set[int]:
        """Load the store's entries; the KV blocks not loaded."""
        hashes, blocks = m.store_loads, m.store_load_to
        if self.store is None:
            return set(blocks)
        missed: set[int] = set()
        outcomes = self.store.load_blocks(hashes, blocks, m.store_load_from or None)
        for h, block, outcome in zip(hashes, blocks, outcomes, strict=True):
            if outcome.loaded:
                continue
            missed.add(block)
            if outcome.reason != "unavailable":  # refused or missing: the allocator drops the entry
                report.refused.append(h)
        return missed

    def _count_hits(self, batch: StepBatch, host_to: list[int], store_to: list[int]) -> None:
        """Count the loaded blocks that stay cached: a block loaded past one
        that was not is computed all the same (`_recompute`), so no hit."""
        bs = self.block_size
        kept = {b for e in batch.entries for b in e.table[: e.cached // bs]}
        for meter, loaded in ((self._host_meter, host_to), (self._store_meter, store_to)):
            hits = sum(1 for b in loaded if b in kept)
            if hits:
                meter.hit_tokens.inc(hits * bs)  # type: ignore[union-attr]

    def _recompute(self, batch: StepBatch, missed: set[int]) -> None:
        """Entries whose computed prefix holds a block not loaded compute from
        that block on (in this forward pass); those tokens are not cached."""
        bs = self.block_size
        for e in batch.entries:
            table = e.table
            for i in range(e.num_computed // bs):
                if table[i] in missed:
                    start = i * bs
                    e.num_new += e.num_computed - start
                    e.num_computed = start
                    lost = max(0, e.cached - start)
                    if lost:
                        e.cached -= lost
                        batch.cached_tokens -= lost
                        if e.seq.num_preemptions == 0:  # its first admission: what usage reports
                            e.seq.num_cached_tokens -= lost
                    break

    def _set_used(self) -> None:
        if self._host_meter is not None and self.host is not None:
            in_use = len(self._written) + (
                self.host.num_slots - self.host_blocks - len(self._swap_free)
            )
            self._host_meter.set_used(in_use * self.host.block_bytes)

    # ------------------------------------------------------------------- swap
    def swap_out(self, batch: StepBatch, seq) -> None:
        """`seq` is preempted in the step `batch` computes: keep the tail of
        its K/V the allocator cannot find in swap slots (`seq.swap`)."""
        bs = self.block_size
        end = seq.num_stored
        last = blocks_for(end, bs)  # blocks holding computed K/V
        # every block it can keep, last ones first; at least those the allocator cannot find
        first = max(0, last - len(self._swap_free))
        if end <= 0 or first > seq.num_valued // bs or seq.prompt_logprobs is not None:
            return  # no room for what only this worker holds: recomputed at resume
        blocks = seq.block_table[first:last]
        slots = [self._swap_free.popleft() for _ in blocks]
        batch.swap_out.append((blocks, slots))
        seq.swap = SwapStash(slots, first * bs, end)

    def swap_in(self, batch: StepBatch, seq, cached: int, num_stored: int) -> int:
        """`seq` (with a stash) is admitted in `batch` holding `num_stored`
        tokens, `cached` found: where its computation starts (the stash
        copied into its new blocks when it continues what was found)."""
        stash, seq.swap = seq.swap, None
        self._swap_free.extend(stash.slots)  # a later save into them comes after this load
        bs = self.block_size
        end = min(stash.end, num_stored - 1)  # at least the last token is computed
        if cached < stash.start or num_stored != len(seq.token_ids) or end <= cached:
            return cached
        first = (cached - stash.start) // bs
        count = blocks_for(end - cached, bs)
        batch.swap_in.append(
            (
                stash.slots[first : first + count],
                seq.block_table[cached // bs : cached // bs + count],
            )
        )
        return end

    def drop_swap(self, seq) -> None:
        """`seq` finished while its tail was swapped out: the slots are free."""
        if seq.swap is not None:
            self._swap_free.extend(seq.swap.slots)
            seq.swap = None
