"""KV blocks in and out of the KV pool as payloads: `[n, 2 (K, V), layers, block_size,
kv_heads, head_dim]` (worker.tiers.layout describes the payload).

On CUDA one indexing kernel per K and V covers a whole move. On the CPU a move is
one strided copy per run of consecutive ids (at worst one per block): torch's CPU
index_select over dim 1 of the pool's 5-d views ran ~10x slower than these copies
(a 64-block move of 1 MiB blocks: 150 ms against 15 ms on one core).
An fp8 pool's blocks move as their bytes (uint8 views: torch's index_copy_
takes no fp8).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from worker.kv_pool import KVPool

__all__ = ["check_ids", "gather", "pair_runs", "read_blocks", "runs", "scatter", "write_blocks"]


def check_ids(what: str, ids: Sequence[int], limit: int, *, distinct: bool) -> None:
    """ValueError unless every id is in [0, limit) (and, with `distinct`, none repeats)."""
    for i in ids:
        if not 0 <= i < limit:
            raise ValueError(f"{what} {i} outside 0..{limit - 1}")
    if distinct and len(set(ids)) != len(ids):
        raise ValueError(f"{what}s repeat in one move: {list(ids)}")


def runs(ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(position, first id, length) of each run of consecutive ids: one copy call per run."""
    i, n = 0, len(ids)
    while i < n:
        j = i + 1
        while j < n and ids[j] == ids[j - 1] + 1:
            j += 1
        yield i, ids[i], j - i
        i = j


def pair_runs(a: Sequence[int], b: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first a, first b, length) of each run where `a` and `b` both go up by one."""
    i, n = 0, len(a)
    while i < n:
        j = i + 1
        while j < n and a[j] == a[j - 1] + 1 and b[j] == b[j - 1] + 1:
            j += 1
        yield a[i], b[i], j - i
        i = j


def read_blocks(
    pool: KVPool, blocks: Sequence[int], out: torch.Tensor, positions: Sequence[int]
) -> None:
    """`out[positions[i]]` = the payload of block `blocks[i]` (`out` on the pool's device)."""
    k, v = pool.k_blocks, pool.v_blocks
    if pool.device.type == "cpu":
        for b, p, r in pair_runs(blocks, positions):
            out[p : p + r, 0].copy_(k[:, b : b + r].transpose(0, 1))
            out[p : p + r, 1].copy_(v[:, b : b + r].transpose(0, 1))
        return
    if getattr(pool, "fp8", False):
        k, v, out = k.view(torch.uint8), v.view(torch.uint8), out.view(torch.uint8)
    idx = torch.tensor(blocks, dtype=torch.long, device=pool.device)
    pos = torch.tensor(positions, dtype=torch.long, device=pool.device)
    out.index_copy_(
        0,
        pos,
        torch.stack((k.index_select(1, idx), v.index_select(1, idx))).permute(2, 0, 1, 3, 4, 5),
    )


def write_blocks(
    pool: KVPool, blocks: Sequence[int], src: torch.Tensor, positions: Sequence[int]
) -> None:
    """Block `blocks[i]` (distinct) = the payload
    `src[positions[i]]` (`src` on the pool's device)."""
    k, v = pool.k_blocks, pool.v_blocks
    if pool.device.type == "cpu":
        for b, p, r in pair_runs(blocks, positions):
            k[:, b : b + r].copy_(src[p : p + r, 0].transpose(0, 1))
            v[:, b : b + r].copy_(src[p : p + r, 1].transpose(0, 1))
        return
    if getattr(pool, "fp8", False):
        k, v, src = k.view(torch.uint8), v.view(torch.uint8), src.view(torch.uint8)
    idx = torch.tensor(blocks, dtype=torch.long, device=pool.device)
    data = src.index_select(0, torch.tensor(positions, dtype=torch.long, device=pool.device))
    k[:, idx] = data[:, 0].transpose(0, 1)
    v[:, idx] = data[:, 1].transpose(0, 1)


def gather(pool: KVPool, blocks: Sequence[int]) -> torch.Tensor:
    """A new contiguous tensor with `blocks`' payloads, on the pool's device."""
    shape = (len(blocks), 2, pool.num_layers, pool.block_size, pool.num_kv_heads, pool.head_dim)
    out = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    read_blocks(pool, blocks, out, range(len(blocks)))
    return out


def scatter(pool: KVPool, blocks: Sequence[int], data: torch.Tensor) -> None:
    """Write payloads `data[i]` (on the pool's device) into blocks `blocks[i]` (distinct)."""
    write_blocks(pool, blocks, data, range(len(blocks)))
