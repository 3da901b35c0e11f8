"""KV blocks in and out of the KV pool as payloads: `[n, 2 (K, V), layers, block_size,
kv_heads, head_dim]`, one indexing op per K and V over every layer (worker.tiers.layout
describes the payload)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from worker.kv_pool import KVPool

__all__ = ["check_ids", "gather", "runs", "scatter"]


def check_ids(what: str, ids: Sequence[int], limit: int, *, distinct: bool) -> None:
    """ValueError unless every id is in [0, limit) (and, with `distinct`, none repeats)."""
    for i in ids:
        if not 0 <= i < limit:
            raise ValueError(f"{what} {i} outside 0..{limit - 1}")
    if distinct and len(set(ids)) != len(ids):
        raise ValueError(f"{what}s repeat in one move: {list(ids)}")


def gather(pool: KVPool, blocks: Sequence[int]) -> torch.Tensor:
    """A new tensor with `blocks`' payloads, on the pool's device (on the current stream)."""
    idx = torch.tensor(blocks, dtype=torch.long, device=pool.device)
    k = pool.k_blocks.index_select(1, idx)
    v = pool.v_blocks.index_select(1, idx)
    return torch.stack((k, v)).permute(2, 0, 1, 3, 4, 5).contiguous()


def scatter(pool: KVPool, blocks: Sequence[int], data: torch.Tensor) -> None:
    """Write payloads `data` (on the pool's device) into `blocks` (distinct), every layer."""
    idx = torch.tensor(blocks, dtype=torch.long, device=pool.device)
    pool.k_blocks[:, idx] = data[:, 0].transpose(0, 1)
    pool.v_blocks[:, idx] = data[:, 1].transpose(0, 1)


def runs(ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(position, first id, length) of each run of consecutive ids: one copy call per run."""
    i, n = 0, len(ids)
    while i < n:
        j = i + 1
        while j < n and ids[j] == ids[j - 1] + 1:
            j += 1
        yield i, ids[i], j - i
        i = j
