"""Ground-truth paged attention: one sequence at a time, plain torch, float32.

Slow on purpose and written to be obviously right; every other backend is
tested against it. Reads exactly the slots a sequence owns (positions
`0..context_len-1` through its block table), nothing else.
"""

from __future__ import annotations

import torch

from worker.attention.metadata import AttentionMetadata
from worker.kv_quant import dequantize, is_fp8


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; caches [num_blocks, B, Hkv, D] already hold this step's K/V
    (fp8 caches read as `float(element) * k_scale` / `v_scale`)."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block = meta.block_size
    tables = meta.block_tables.tolist()
    out = torch.empty_like(q)
    start = 0
    for s, (new, ctx) in enumerate(zip(meta.host_query_lens, meta.host_context_lens, strict=True)):
        pos = torch.arange(ctx, device=q.device)
        blocks = torch.tensor(tables[s], dtype=torch.long, device=q.device)[pos // block]
        # [ctx, Hkv, D] -> one K/V row per query head (query head h reads kv head h // group)
        k = _read(k_cache[blocks, pos % block], k_scale).repeat_interleave(group, dim=1)
        v = _read(v_cache[blocks, pos % block], v_scale).repeat_interleave(group, dim=1)
        qs = q[start : start + new].float()
        scores = torch.einsum("nhd,chd->hnc", qs, k) * scale
        q_pos = torch.arange(ctx - new, ctx, device=q.device)
        causal = pos[None, :] <= q_pos[:, None]  # [new, ctx]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[start : start + new] = torch.einsum("hnc,chd->nhd", probs, v).to(q.dtype)
        start += new
    return out


def _read(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache rows in float32: dequantized when the cache is fp8."""
    return dequantize(rows, scale) if is_fp8(rows.dtype) else rows.float()
