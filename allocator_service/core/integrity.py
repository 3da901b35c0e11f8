"""The invariants of a `BlockPool` (listed in its module docstring), checked
over its whole state: what the service answers to GetPoolStats with
`check_integrity` and DumpPool, and what the property tests assert after
every operation.

A broken invariant is a bug in the allocator, never the caller's doing, so it
is reported as readable lines rather than raised.
"""

from __future__ import annotations

from allocator_service.core.blocks import blocks_for
from allocator_service.core.pause_points import CHUNK, chunks, pace
from allocator_service.core.state import PoolState


def integrity_problems(pool: PoolState) -> list[str]:
    """Every broken invariant, as a readable line (empty when sound)."""
    problems: list[str] = []
    n, B = pool.num_blocks, pool.block_size
    p = pool.parts()
    fill, ref_cnt, block_hash, seqs = p.fill, p.ref_cnt, p.block_hash, p.seqs
    named = [0] * n
    for sid, seq in seqs.items():
        pace()
        if len(seq.table) != blocks_for(seq.num_tokens, B):
            problems.append(f"{sid}: {len(seq.table)} blocks for {seq.num_tokens} tokens")
        if len(set(seq.table)) != len(seq.table):
            problems.append(f"{sid}: table lists a block twice: {seq.table}")
        for i, b in enumerate(seq.table):
            if not i % CHUNK:
                pace()
            if not 0 <= b < n:
                problems.append(f"{sid}: block {b} out of range")
                continue
            named[b] += 1
            expect = min(B, seq.num_tokens - i * B)
            if fill[b] != expect:
                problems.append(f"{sid}: block {b} holds {fill[b]} tokens, table says {expect}")
        if not 0 <= seq.reserved <= seq.num_tokens:
            problems.append(f"{sid}: {seq.reserved} reserved slots of {seq.num_tokens}")
        known = seq.num_tokens - seq.reserved  # slots whose token values the pool has
        if pool.enable_prefix_caching and (
            seq.num_hashed != known // B or len(seq.tail) != known % B
        ):
            problems.append(
                f"{sid}: {seq.num_hashed} chain hashes and {len(seq.tail)} tail tokens "
                f"for {known} known tokens"
            )
        for i in range(len(seq.apart), min(seq.num_hashed, len(seq.table))):
            if 0 <= (b := seq.table[i]) < n and not block_hash.holds(b):
                problems.append(f"{sid}: chain hash {i} is its block {b}'s, which holds none")
    entries = sum(len(seq.table) for seq in seqs.values())
    if pool.table_entries != entries:
        problems.append(
            f"the pool counts {pool.table_entries} table entries, its tables hold {entries}"
        )
    names = sum(len(s) + len(seq.salt or "") for s, seq in seqs.items())
    if pool.name_chars != names:
        problems.append(
            f"the pool counts {pool.name_chars} characters of names, its sequences hold {names}"
        )
    if (
        entries > pool.max_table_entries
        or len(seqs) > pool.max_sequences
        or names > pool.max_name_chars
    ):
        problems.append(
            f"{len(seqs)} sequences, {entries} table entries and {names} characters "
            "of names exceed the pool's bounds"
        )
    uncached, cached = list(p.uncached_free), list(p.cached_free)
    free = uncached + cached
    if len(set(free)) != len(free):
        problems.append("a block is listed twice in the free queue")
    for part in chunks(free):
        for b in part:
            if named[b]:
                problems.append(f"block {b} is free and in a table (double-booked)")
    for part in chunks(range(n)):
        for b in part:
            if ref_cnt[b] != named[b]:
                problems.append(f"block {b}: refcount {ref_cnt[b]} but {named[b]} tables name it")
    if len(set(free)) + sum(1 for c in named if c) != n:
        problems.append("a block is lost (neither free nor in a table)")
    for part in chunks(uncached):
        for b in part:
            if block_hash.holds(b):
                problems.append(f"uncached free block {b} holds a hash")
    for part in chunks(cached):
        for b in part:
            if not block_hash.holds(b):
                problems.append(f"cached free block {b} holds no hash")
    indexed = 0
    for i, (h, holders) in enumerate(pool.index.entries()):
        if not i % CHUNK:
            pace()
        for b in holders:
            indexed += 1
            if not block_hash.holds_hash(b, h):
                problems.append(f"the cache index maps a hash to block {b}, which holds another")
            if fill[b] != B:
                problems.append(f"cached block {b} is not full")
    if indexed != block_hash.num_held():
        problems.append("a block holds a hash the cache index does not know")
    if pool.tiers is not None:
        problems.extend(pool.tiers.problems())
    return problems
