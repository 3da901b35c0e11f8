"""The live view behind `/pools`: per pool, what each block holds, as an
initial frame and then changes only.

A stream (one per open page, counted against the server's WatchEvents
limit) follows the service's KV event log, the one `WatchEvents` reads: it
wakes on every published event and forwards the events' per-pool counts.
Block occupancy (which sequence holds which block) is not in that log, so a
pool whose last step id moved, or that had an event, is read again, under
its own lock only, taking plain list copies (`read_pool`); the stream sends
the blocks whose state differs from what it sent before (`diff`). A large
pool is read at most every `min_interval(n)` seconds.

Block states (`FREE`, `CACHED`, `USED`) are the core's own: a block with a
refcount is in use, a free block with a hash is cached (evictable, in the
order of `BlockPool.free_order`), any other is free.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

FREE, CACHED, USED = 0, 1, 2
# Pools up to this many blocks also send their eviction order.
ORDER_LIMIT = 8192


@dataclass(slots=True)
class PoolFrame:
    """What a stream last sent of one pool."""

    pool_id: str
    state: list[int]
    owner: list[str | None]
    ref: list[int]
    step: int = -1
    read_at: float = 0.0
    counters: dict[str, Any] = field(default_factory=dict)


def read_pool(entry) -> tuple[list[int], list[str | None], list[int], dict[str, Any], int]:
    """(state, owner, refcount) per block, the counters and the last step id
    of a `PoolEntry`. Under the pool's lock: copies only."""
    with entry.lock:
        pool = entry.pool
        ref = pool.ref_cnt[:]
        hashes = pool.index.block_hash.copy()
        free = pool.free_order()
        tables = pool.tables()
        step = entry.last_step_id
        counters = {
            "num_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "prefix_caching": pool.enable_prefix_caching,
            "prefix_queried_tokens": pool.prefix_queried_tokens,
            "prefix_hit_tokens": pool.prefix_hit_tokens,
            "evictions": pool.evictions,
            "copies": pool.copies,
            "out_of_blocks": pool.out_of_blocks,
            "sequences": len(tables),
            "tokens": sum(pool.num_tokens(s) for s in tables),
        }
        tiers = pool.tiers
        if tiers is not None:  # the KV tiers below the pool (docs/architecture.md, "Tiers")
            host, store = tiers.host, tiers.store
            counters["tiers"] = {
                "host_blocks": host.lru.capacity if host is not None else 0,
                "host_used": len(host.lru) if host is not None else 0,
                "shared_store": store is not None,
                "store_used_bytes": store.lru.used if store is not None else 0,
                "host_hit_tokens": tiers.stats.host_hit_tokens,
                "store_hit_tokens": tiers.stats.store_hit_tokens,
                "host_saves": tiers.stats.host_saves,
                "store_saves": tiers.stats.store_saves,
                "refused": tiers.stats.refused_loads,
            }
    n = len(ref)
    state = [USED if r else FREE for r in ref]
    cached_order = [b for b in free if hashes[b] is not None]
    for b in cached_order:
        state[b] = CACHED
    # oldest (next evicted) first; a large pool's page shades cached blocks alike
    counters["cached_order"] = cached_order if n <= ORDER_LIMIT else None
    owner: list[str | None] = [None] * n
    for seq_id, table in tables.items():
        for b in table:
            if owner[b] is None:
                owner[b] = seq_id
    return state, owner, ref, counters, step


def init_message(entry, frame: PoolFrame) -> dict[str, Any]:
    return {
        "pool": entry.pool_id,
        "worker": entry.worker_id,
        "kv_role": entry.pool.config.kv_role,  # its part in prefill/decode disaggregation
        "state": frame.state,
        "owner": frame.owner,
        "ref": frame.ref,
        "counters": frame.counters,
    }


def diff(old: PoolFrame, state: list[int], owner: list[str | None], ref: list[int]) -> list[list]:
    """[[block, state, owner, refcount], ...] for every block that changed."""
    out = []
    os_, oo, orf = old.state, old.owner, old.ref
    for b in range(len(state)):
        if state[b] != os_[b] or owner[b] != oo[b] or ref[b] != orf[b]:
            out.append([b, state[b], owner[b], ref[b]])
    return out


def min_interval(num_blocks: int) -> float:
    """Least time between two reads of one pool: 50 ms, 0.5 s at 100k blocks."""
    return max(0.05, num_blocks / 200_000)


def sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def stream(service, stopping: Callable[[], bool], keepalive_s: float = 10.0) -> Iterator[bytes]:
    """Server-sent events for `/pools/stream`: `init` per pool, then
    `blocks` (changed blocks and counters), `kv` (the event log's counts per
    pool since the last message), `drop`; a comment line when idle."""
    frames: dict[str, PoolFrame] = {}
    events = service.events
    cursor = events.published
    last_sent = time.monotonic()
    dirty: set[str] = set()
    wait = 0.1
    while not stopping() and not events.closed:
        batch, cursor, gap = events.read(cursor, 1000, wait)
        wait = 0.1  # or until a pool held back by min_interval may be read again
        kv: dict[str, dict[str, int]] = {}
        for e in batch:
            counts = kv.setdefault(e.pool_id, {})
            counts[e.kind] = counts.get(e.kind, 0) + 1
            dirty.add(e.pool_id)
        if gap:
            dirty.update(frames)
        now = time.monotonic()
        pools = dict(service.registry.pools)
        for pool_id in [p for p in frames if p not in pools]:
            del frames[pool_id]
            last_sent = now
            yield sse("drop", {"pool": pool_id})
        for pool_id, entry in pools.items():
            frame = frames.get(pool_id)
            if frame is not None:
                changed = pool_id in dirty or entry.last_step_id != frame.step
                if not changed:
                    continue
                early = frame.read_at + min_interval(len(frame.state)) - now
                if early > 0:
                    dirty.add(pool_id)
                    wait = min(wait, max(early, 0.005))
                    continue
            state, owner, ref, counters, step = read_pool(entry)
            dirty.discard(pool_id)
            if frame is None or len(frame.state) != len(state):
                frame = frames[pool_id] = PoolFrame(pool_id, state, owner, ref, step, now, counters)
                yield sse("init", init_message(entry, frame))
            else:
                blocks = diff(frame, state, owner, ref)
                frame.state, frame.owner, frame.ref, frame.step, frame.read_at = (
                    state,
                    owner,
                    ref,
                    step,
                    now,
                )
                if not blocks and counters == frame.counters:
                    continue
                frame.counters = counters
                yield sse("blocks", {"pool": pool_id, "blocks": blocks, "counters": counters})
            last_sent = now
        if kv:
            last_sent = now
            yield sse("kv", kv)
        if now - last_sent > keepalive_s:
            last_sent = now
            yield b": idle\n\n"


def sequence_table(service, pool_id: str, seq_id: str) -> dict[str, Any] | None:
    """One sequence's block table in order (under its pool's lock), or None."""
    entry = service.registry.pools.get(pool_id)
    if entry is None:
        return None
    with entry.lock:
        pool = entry.pool
        if not pool.has_sequence(seq_id):
            return None
        table, tokens = pool.block_table(seq_id), pool.num_tokens(seq_id)
        refs = [pool.ref_cnt[b] for b in table]
    return {
        "pool": pool_id,
        "seq": seq_id,
        "table": table,
        "tokens": tokens,
        "refcounts": refs,
        "block_size": pool.block_size,
    }
