"""A `BlockPool` as plain data, through its public `parts()` / `from_parts()`:
the full dump (`to_state`, JSON-able: DumpPool and snapshots; rebuilt exactly
by `BlockPool.from_state`), the packed dump snapshots store (`to_packed`, read
back by `parts_of` too) and the short view `pagedkv replay` prints
(`pool_view`).

The packed dump (`PACKED`) never repeats what forks and prefix hits share: a
block table is a list of segments, each a run of consecutive block ids or a
copy of the entries at the same positions of an earlier sequence's table; a
hash chain is copied from an earlier sequence, taken from its blocks' hashes,
or given literally. Per-block columns are little-endian integer arrays,
zlib-compressed, base64-encoded. Its size is O(blocks + sequences + their
names' characters + segments), never O(the sum of table lengths)
(`wire.bounds.packed_bound`).

NOTE: the dump's keys and encoding are a stored format (Redis snapshots,
existing journals): change them only with a new snapshot format.
"""

from __future__ import annotations

import base64
import json
import sys
import zlib
from array import array
from typing import Any

from allocator_service.core.block_hashes import HASH_BYTES, BlockHashes
from allocator_service.core.pause_points import chunks, pace
from allocator_service.core.sequence import SeqEntry
from allocator_service.core.state import PoolState


def to_state(pool: PoolState) -> dict[str, Any]:
    """A JSON-able dump of the whole state of `pool`."""
    p = pool.parts()
    return {
        "config": _config(pool),
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
                "hashes": [h.hex() for part in chunks(q.chain(p.block_hash)) for h in part],
                "tail": list(q.tail),
                # NOTE: only when set, so a dump without reservations has the
                # keys every stored snapshot has (older ones read as 0).
                **({"reserved": q.reserved} if q.reserved else {}),
            }
            for s, q in p.seqs.items()
        },
        "counters": _counters(pool),
        **({"tiers": pool.tiers.to_state()} if pool.tiers is not None else {}),
    }


def _config(pool: PoolState) -> dict[str, Any]:
    return {
        "num_blocks": pool.num_blocks,
        "block_size": pool.block_size,
        "enable_prefix_caching": pool.enable_prefix_caching,
        "model_fingerprint": pool.config.model_fingerprint,
        # NOTE: only with tiers, so a dump without them has the keys
        # every stored snapshot has.
        **(
            {
                "host_blocks": pool.config.host_blocks,
                "layout": pool.config.layout,
                "block_bytes": pool.config.block_bytes,
                "use_shared_store": pool.config.use_shared_store,
            }
            if pool.config.tiered
            else {}
        ),
        **({"store_group": pool.config.store_group} if pool.config.store_group else {}),
        **({"kv_role": pool.config.kv_role} if pool.config.kv_role != "both" else {}),
    }


def _counters(pool: PoolState) -> dict[str, int]:
    return {
        "prefix_queried_tokens": pool.prefix_queried_tokens,
        "prefix_hit_tokens": pool.prefix_hit_tokens,
        "evictions": pool.evictions,
        "copies": pool.copies,
        "out_of_blocks": pool.out_of_blocks,
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
        return (
            "{" + ",".join(json.dumps(k) + ":" + dumps_chunked(v) for k, v in value.items()) + "}"
        )
    if isinstance(value, list) and len(value) > _CHUNK:
        parts = (json.dumps(part, separators=(",", ":"))[1:-1] for part in chunks(value, _CHUNK))
        return "[" + ",".join(parts) + "]"
    return json.dumps(value, separators=(",", ":"))


def parts_of(state: dict[str, Any]) -> tuple[tuple, dict[str, int]]:
    """The fields of a `PoolParts` (in its order) and the counters that a
    dump holds (a full one or a packed one): `BlockPool.from_state` builds
    the pool from them."""
    if state.get("encoding") == PACKED:
        return _parts_of_packed(state)
    seqs = {
        s: _seq(
            list(q["table"]),
            q["num_tokens"],
            q["salt"],
            [bytes.fromhex(h) for h in q["hashes"]],
            list(q["tail"]),
            q.get("reserved", 0),
        )
        for s, q in state["seqs"].items()
    }
    parts = (
        list(state["ref_cnt"]),
        list(state["fill"]),
        BlockHashes.of([bytes.fromhex(h) if h else None for h in state["hash"]]),
        state["uncached_free"],
        state["cached_free"],
        list(state["stamp"]),
        state["clock"],
        seqs,
    )
    return parts, dict(state["counters"])


# ------------------------------------------------------------ the packed dump

PACKED = "packed/1"


def _pack(values: Any, code: str = "q") -> str:
    a = array(code, values)
    if sys.byteorder != "little":
        a.byteswap()
    return base64.b64encode(zlib.compress(a.tobytes(), 1)).decode()


def _unpack(text: str, code: str = "q") -> list[int]:
    a = array(code)
    a.frombytes(zlib.decompress(base64.b64decode(text)))
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def _common_run(a: list, b: list, i: int) -> int:
    """The largest n with a[i:i+n] == b[i:i+n] (a[i] == b[i] is known):
    galloping slice comparisons, in C, O(n log n) element compares."""
    m = min(len(a), len(b)) - i
    if a[i : i + m] == b[i : i + m]:
        return m
    lo, step = 1, 1  # a[i:i+lo] matches
    while lo + step < m and a[i + lo : i + lo + step] == b[i + lo : i + lo + step]:
        lo += step
        step *= 2
    hi = min(lo + step, m)  # a[i:i+hi] does not match
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[i + lo : i + mid] == b[i + lo : i + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _table_segments(t: int, table: list[int], tables: list[list[int]], owner: array) -> list[int]:
    """Sequence `t`'s table as (start, n) runs of ids start..start+n-1 and
    (~s, n) copies of sequence s's entries at the same positions; `owner[b]`:
    the first sequence naming block b (-1: none yet)."""
    segs: list[int] = []
    i, n = 0, len(table)
    while i < n:
        b = table[i]
        s = owner[b]
        if 0 <= s != t and i < len(tables[s]) and tables[s][i] == b:
            k = _common_run(table, tables[s], i)
            segs += (~s, k)
            i += k
            continue
        if s < 0:
            owner[b] = t
        j = i + 1
        while j < n and table[j] == table[j - 1] + 1 and owner[table[j]] < 0:
            owner[table[j]] = t
            j += 1
        segs += (b, j - i)
        i = j
    return segs


def _hash_segments(
    t: int,
    hashes: list[bytes],
    table: list[int],
    chains: list[list[bytes]],
    owner: array,
    held: list[bytes | None],
    literal: list[bytes],
) -> list[int]:
    """Sequence `t`'s hash chain as (s, n) copies of sequence s's hashes at
    the same positions, (-1, n) runs equal to the hashes the table's blocks
    hold there (`held`, position by position), and (-2, n) literals
    (appended to `literal`)."""
    segs: list[int] = []
    i, n = 0, len(hashes)
    while i < n:
        s = owner[table[i]]
        if 0 <= s != t and i < len(chains[s]) and chains[s][i] == hashes[i]:
            k = _common_run(hashes, chains[s], i)
            segs += (s, k)
            i += k
            continue
        j = i
        while j < n and held[j] == hashes[j]:
            j += 1
        if j > i:
            segs += (-1, j - i)
            i = j
            continue
        segs += (-2, 1)
        literal.append(hashes[i])
        i += 1
    return segs


def to_packed(pool: PoolState) -> dict[str, Any]:
    """The whole state of `pool` as the packed dump (see the module
    docstring); `parts_of` reads it back exactly."""
    p = pool.parts()
    block_hash = p.block_hash
    hashed = [b for part in chunks(range(len(block_hash))) for b in part if block_hash.holds(b)]
    pace()
    owner = array("i", [-1]) * len(block_hash)
    tables: list[list[int]] = []
    chains: list[list[bytes]] = []
    seqs = []
    for t, (seq_id, q) in enumerate(p.seqs.items()):
        literal: list[bytes] = []
        chain = q.chain(block_hash)
        table_segs = _table_segments(t, q.table, tables, owner)
        held = block_hash.at(q.table[: len(chain)])
        hash_segs = _hash_segments(t, chain, q.table, chains, owner, held, literal)
        tables.append(q.table)
        chains.append(chain)
        seqs.append(
            [
                seq_id,
                q.num_tokens,
                q.salt,
                q.reserved,
                table_segs,
                hash_segs,
                base64.b64encode(b"".join(literal)).decode(),
                list(q.tail),
            ]
        )
        pace()
    return {
        "encoding": PACKED,
        "config": _config(pool),
        "ref_cnt": _pack(p.ref_cnt),
        "fill": _pack(p.fill),
        "hashed": _pack(hashed),
        "hashes": base64.b64encode(
            b"".join(block_hash.data[b * HASH_BYTES : (b + 1) * HASH_BYTES] for b in hashed)
        ).decode(),
        "uncached_free": _pack(p.uncached_free),
        "cached_free": _pack(p.cached_free),
        "stamp": _pack(p.stamp),
        "clock": p.clock,
        "seqs": seqs,
        "counters": _counters(pool),
        **({"tiers": pool.tiers.to_state()} if pool.tiers is not None else {}),
    }


def _parts_of_packed(state: dict[str, Any]) -> tuple[tuple, dict[str, int]]:
    n = state["config"]["num_blocks"]
    raw = base64.b64decode(state["hashes"])
    block_hash: list[bytes | None] = [None] * n
    for k, b in enumerate(_unpack(state["hashed"])):
        block_hash[b] = raw[k * HASH_BYTES : (k + 1) * HASH_BYTES]
    tables: list[list[int]] = []
    chains: list[list[bytes]] = []
    seqs = {}
    for seq_id, num_tokens, salt, reserved, table_segs, hash_segs, literal, tail in state["seqs"]:
        table: list[int] = []
        for a, k in zip(table_segs[::2], table_segs[1::2], strict=True):
            i = len(table)
            table += tables[~a][i : i + k] if a < 0 else range(a, a + k)
        lit = base64.b64decode(literal)
        hashes: list[bytes] = []
        used = 0
        for s, k in zip(hash_segs[::2], hash_segs[1::2], strict=True):
            i = len(hashes)
            if s >= 0:
                hashes += chains[s][i : i + k]
            elif s == -1:
                hashes += (block_hash[b] for b in table[i : i + k])  # type: ignore[misc]
            else:
                hashes += (
                    lit[j * HASH_BYTES : (j + 1) * HASH_BYTES] for j in range(used, used + k)
                )
                used += k
        tables.append(table)
        chains.append(hashes)
        seqs[seq_id] = _seq(table, num_tokens, salt, hashes, list(tail), reserved)
    parts = (
        _unpack(state["ref_cnt"]),
        _unpack(state["fill"]),
        BlockHashes.of(block_hash),
        _unpack(state["uncached_free"]),
        _unpack(state["cached_free"]),
        _unpack(state["stamp"]),
        state["clock"],
        seqs,
    )
    return parts, dict(state["counters"])


def _seq(
    table: list[int],
    num_tokens: int,
    salt: str | None,
    chain: list[bytes],
    tail: list[int],
    reserved: int,
) -> SeqEntry:
    """A dump's sequence, its whole chain kept apart (`from_parts` keeps
    only what its blocks do not hold)."""
    return SeqEntry(
        table=table,
        num_tokens=num_tokens,
        salt=salt,
        tail=tail,
        reserved=reserved,
        num_hashed=len(chain),
        apart=tuple(chain),
    )


def pool_view(pool: PoolState) -> dict[str, Any]:
    """The state columns `pagedkv replay` prints after each operation
    (refcount keys as strings, as JSON has them)."""
    return {
        "tables": pool.tables(),
        "free": pool.free_order(),
        "refcounts": {str(b): c for b, c in pool.refcounts().items()},
        "wasted_slots": pool.stats().wasted_slots,
    }
