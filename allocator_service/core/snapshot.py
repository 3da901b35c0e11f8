"""A `BlockPool` as plain data: the full dump (`to_state`/`parts_of`: what
the service's snapshots and DumpPool carry, JSON-able, rebuilt exactly by
`BlockPool.from_state`) and the short view `pagedkv replay` prints after each
operation (`pool_view`). Reads and builds the pool through its public
`parts()` / `from_parts()`.

NOTE: the dump's keys and encoding are a stored format (Redis snapshots,
existing journals' snapshots): change them only with a new snapshot format.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from allocator_service.core.pacing import chunks
from allocator_service.core.sequence import Seq

if TYPE_CHECKING:  # the pool calls in here; this module only reads it
    from allocator_service.core.pool import BlockPool


def to_state(pool: BlockPool) -> dict[str, Any]:
    """A JSON-able dump of the whole state of `pool`."""
    p = pool.parts()
    return {
        "config": {
            "num_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "enable_prefix_caching": pool.enable_prefix_caching,
            "model_fingerprint": pool.config.model_fingerprint,
            # NOTE: only with tiers, so a dump without them has the keys
            # every stored snapshot has.
            **({"host_blocks": pool.config.host_blocks, "layout": pool.config.layout,
                "block_bytes": pool.config.block_bytes, "use_shared_store": pool.config.use_shared_store}
               if pool.config.tiered else {}),
        },
        "ref_cnt": list(p.ref_cnt),
        "fill": list(p.fill),
        "hash": [h.hex() if h else None for part in chunks(p.block_hash) for h in part],
        "uncached_free": list(p.uncached_free),
        "cached_free": list(p.cached_free),
        "stamp": list(p.stamp),
        "clock": p.clock,
        "seqs": {
            s: {
                "table": list(q.table),
                "num_tokens": q.num_tokens,
                "salt": q.salt,
                "hashes": [h.hex() for part in chunks(q.hashes) for h in part],
                "tail": list(q.tail),
                # NOTE: only when set, so a dump without reservations has the
                # keys every stored snapshot has (older ones read as 0).
                **({"reserved": q.reserved} if q.reserved else {}),
            }
            for s, q in p.seqs.items()
        },
        "counters": {
            "prefix_queried_tokens": pool.prefix_queried_tokens,
            "prefix_hit_tokens": pool.prefix_hit_tokens,
            "evictions": pool.evictions,
            "copies": pool.copies,
            "out_of_blocks": pool.out_of_blocks,
        },
        **({"tiers": pool.tiers.to_state()} if pool.tiers is not None else {}),
    }


# Elements per json.dumps call in `dumps_chunked`: one call runs in C without
# letting another thread run; 4,096 block hashes took 1.1 ms, 512 take 0.12.
_CHUNK = 512


def dumps_chunked(value: Any) -> str:
    """`json.dumps(value, separators=(",", ":"))`, the same text, built from
    short calls: one json.dumps of a large pool's dump runs for tens of
    milliseconds in C without letting another thread run (the service's
    other pools); list slices and dict entries let the interpreter switch."""
    if isinstance(value, dict) and len(value) > 1:
        return "{" + ",".join(json.dumps(k) + ":" + dumps_chunked(v) for k, v in value.items()) + "}"
    if isinstance(value, list) and len(value) > _CHUNK:
        parts = (json.dumps(part, separators=(",", ":"))[1:-1] for part in chunks(value, _CHUNK))
        return "[" + ",".join(parts) + "]"
    return json.dumps(value, separators=(",", ":"))


def parts_of(state: dict[str, Any]) -> tuple[tuple, dict[str, int]]:
    """The fields of a `PoolParts` (in its order) and the counters that a
    dump holds: `BlockPool.from_state` builds the pool from them."""
    seqs = {
        s: Seq(
            table=list(q["table"]),
            num_tokens=q["num_tokens"],
            salt=q["salt"],
            hashes=[bytes.fromhex(h) for h in q["hashes"]],
            tail=list(q["tail"]),
            reserved=q.get("reserved", 0),
        )
        for s, q in state["seqs"].items()
    }
    parts = (
        list(state["ref_cnt"]),
        list(state["fill"]),
        [bytes.fromhex(h) if h else None for h in state["hash"]],
        state["uncached_free"],
        state["cached_free"],
        list(state["stamp"]),
        state["clock"],
        seqs,
    )
    return parts, dict(state["counters"])


def pool_view(pool: BlockPool) -> dict[str, Any]:
    """The state columns `pagedkv replay` prints after each operation
    (refcount keys as strings, as JSON has them)."""
    return {
        "tables": pool.tables(),
        "free": pool.free_order(),
        "refcounts": {str(b): c for b, c in pool.refcounts().items()},
        "wasted_slots": pool.stats().wasted_slots,
    }
