"""A `BlockPool` as plain data: the full dump (`to_state`/`restore`: what
the service's snapshots and DumpPool carry, JSON-able, rebuilt exactly) and
the short view `pagedkv replay` prints after each operation (`pool_view`).

NOTE: the dump's keys and encoding are a stored format (Redis snapshots,
existing journals' snapshots): change them only with a new snapshot format.
"""

from __future__ import annotations

import json
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

from allocator_service.core.pacing import chunks
from allocator_service.core.prefix_index import PrefixIndex
from allocator_service.core.sequence import Seq

if TYPE_CHECKING:  # the pool calls in here; this module only reads and fills it
    from allocator_service.core.pool import BlockPool


def to_state(pool: BlockPool) -> dict[str, Any]:
    """A JSON-able dump of the whole state of `pool`."""
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
        "ref_cnt": list(pool.ref_cnt),
        "fill": list(pool._fill),
        "hash": [h.hex() if h else None for part in chunks(pool.index.block_hash) for h in part],
        "uncached_free": list(pool._uncached_free),
        "cached_free": list(pool._cached_free),
        "stamp": list(pool._stamp),
        "clock": pool._clock,
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
            for s, q in pool._seqs.items()
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


def restore(pool: BlockPool, state: dict[str, Any]) -> None:
    """Fill a fresh pool of `state["config"]` with the dumped state."""
    pool.ref_cnt = list(state["ref_cnt"])
    pool._fill = list(state["fill"])
    pool.index = PrefixIndex([bytes.fromhex(h) if h else None for h in state["hash"]], pool.index.event_sink)
    pool._uncached_free = deque(state["uncached_free"])
    pool._cached_free = OrderedDict((b, None) for b in state["cached_free"])
    pool._stamp = list(state["stamp"])
    pool._clock = state["clock"]
    for s, q in state["seqs"].items():
        pool._seqs[s] = Seq(
            table=list(q["table"]),
            num_tokens=q["num_tokens"],
            salt=q["salt"],
            hashes=[bytes.fromhex(h) for h in q["hashes"]],
            tail=list(q["tail"]),
            reserved=q.get("reserved", 0),
        )
    pool.table_entries = sum(len(q.table) for q in pool._seqs.values())
    pool.name_chars = sum(len(s) + len(q.salt or "") for s, q in pool._seqs.items())
    for k, v in state["counters"].items():
        setattr(pool, k, v)
    if pool.tiers is not None:
        pool.tiers.restore(state["tiers"])


def pool_view(pool: BlockPool) -> dict[str, Any]:
    """The state columns `pagedkv replay` prints after each operation
    (refcount keys as strings, as JSON has them)."""
    return {
        "tables": pool.tables(),
        "free": pool.free_order(),
        "refcounts": {str(b): c for b, c in pool.refcounts().items()},
        "wasted_slots": pool.stats().wasted_slots,
    }
