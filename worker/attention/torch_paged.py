"""Vectorised paged attention in torch: the CPU fast path, and the prefill path everywhere.

Decodes (one new token per sequence) are served together, in four ops:
1. one `index_select` gathers the batch's keys into a `[b, Hkv, L, D]` buffer
   (L = longest context), reused from call to call;
2. one batched matmul gives the scores, plus an additive 0/-inf mask;
3. softmax;
4. `embedding_bag` forms probs @ V straight from the pool (each (sequence,
   query head) is a bag of value rows weighted by its probabilities), so the
   values are never copied. On these CPUs that is about twice as fast as
   gathering V and a matmul.
Prefills are served one sequence at a time: gather its context once, SDPA with
a causal mask offset by the cached prefix.

An fp8 cache is dequantized as it is gathered (the layer's `k_scale`/`v_scale`)
into the query's dtype; its decodes gather V too and use a matmul, as
`embedding_bag` cannot weigh fp8 rows.

The gather indices depend only on the metadata and the head counts, so they
are computed once per step (the first layer) and reused by every layer.

NaN safety: a gathered position past a sequence's context is redirected to
that sequence's own position 0 (always owned, since context >= 1) before the
gather, so no slot the sequence does not own is ever read; the mask then gives
those positions zero weight. Masking alone would not do: 0 * NaN is NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention.metadata import AttentionMetadata
from worker.kv_quant import dequantize, is_fp8

__all__ = ["DecodeFn", "PagedAttention", "context_slots"]

# decode_fn(q [b, Hq, D], k_cache, v_cache, block_tables [b, W], context_lens [b],
# max_context_len, scale, k_scale, v_scale) -> [b, Hq, D]: a drop-in for the torch decode path.
DecodeFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        int,
        float,
        float,
        float,
    ],
    torch.Tensor,
]


def context_slots(
    block_tables: torch.Tensor, context_lens: torch.Tensor, length: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slot ids [b, length] of positions 0..length-1 and their validity mask.

    Invalid positions (>= context_len) point at the sequence's own position 0,
    so a gather through these ids only touches slots the sequence owns.
    """
    pos = torch.arange(length, device=block_tables.device)
    valid = pos[None, :] < context_lens[:, None].to(pos.dtype)
    blocks = block_tables[:, pos // block_size].to(torch.int64)
    slots = blocks * block_size + pos % block_size
    return torch.where(valid, slots, slots[:, :1]), valid


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    """Gather indices for b decoding sequences (see the module docstring)."""

    key_rows: torch.Tensor  # [b*Hkv*L] rows of the cache viewed as [slots*Hkv, D]
    value_bags: torch.Tensor  # [b*Hq, L] the same rows, once per query head
    bias: torch.Tensor  # [b, 1, 1, L] float32: 0 where valid, -inf past the context
    length: int  # L


@dataclass(frozen=True, slots=True)
class _PrefillPlan:
    """One prefilling sequence: rows of q it owns, its context slots, its causal mask."""

    start: int
    new: int
    slots: torch.Tensor  # [ctx] all valid
    mask: torch.Tensor  # [G*new, ctx] bool, query row g*new+i sees positions <= its own


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """The decoding sequences of a step, served together."""

    rows: torch.Tensor | None  # their rows in q; None when every sequence decodes
    block_tables: torch.Tensor  # [b, W] their tables
    context_lens: torch.Tensor  # [b]
    max_context_len: int
    plan: _DecodePlan | None  # gather indices for the torch path (None when decode_fn serves it)


@dataclass(frozen=True, slots=True)
class _StepPlan:
    decodes: _DecodeGroup | None  # None when no sequence decodes
    prefills: tuple[_PrefillPlan, ...]


def _decode_plan(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    length: int,
    block_size: int,
    num_kv_heads: int,
    group: int,
) -> _DecodePlan:
    batch = block_tables.shape[0]
    slots, valid = context_slots(block_tables, context_lens, length, block_size)
    heads = torch.arange(num_kv_heads, device=slots.device)
    rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]  # [b, Hkv, L]
    bags = rows[:, :, None, :].expand(batch, num_kv_heads, group, length).reshape(-1, length)
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=slots.device)
    bias.masked_fill_(~valid, float("-inf"))
    return _DecodePlan(rows.reshape(-1), bags, bias[:, None, None, :], length)


class PagedAttention:
    """A paged-attention backend (see `worker.attention`): mixed prefill/decode batches.

    Decodes go together to `decode_fn` (None = the torch path above), prefills
    one by one to SDPA. One instance serves one model: it remembers the plan of
    the last metadata it saw (by identity) so that layers 2..N of a step reuse
    it, and keeps a key buffer that grows to the largest batch seen.
    """

    def __init__(
        self,
        decode_fn: DecodeFn | None = None,
        decode_dtypes: tuple[torch.dtype, ...] | None = None,
        compile_fn: Callable[[torch.dtype], None] | None = None,
    ) -> None:
        self.decode_fn = decode_fn
        # The query dtypes `decode_fn` takes, over a cache of that dtype or fp8 (None: all);
        # other dtypes use the torch path.
        self.decode_dtypes = decode_dtypes
        self._compile_fn = compile_fn
        self._plan_key: tuple[AttentionMetadata, int, int, bool] | None = None
        self._plan: _StepPlan | None = None
        self._key_buffer: torch.Tensor | None = None

    def prepare(self, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> None:
        """Compile now what decodes of a `dtype` model over a `cache_dtype` cache
        (default: `dtype`) will run (a kernel compiled on first use would stall
        the first requests instead); dtypes `decode_fn` does not take compile nothing."""
        cache_dtype = cache_dtype or dtype
        if self._compile_fn is not None and self._takes(dtype, cache_dtype):
            self._compile_fn(cache_dtype)

    def _takes(self, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        """Whether `decode_fn` serves queries of `dtype` over a `cache_dtype` cache."""
        if self.decode_fn is None:
            return False
        return self.decode_dtypes is None or (
            dtype in self.decode_dtypes and (cache_dtype == dtype or is_fp8(cache_dtype))
        )

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        num_kv_heads = k_cache.shape[2]
        use_fn = self._takes(q.dtype, k_cache.dtype)
        plan = self._step_plan(meta, num_kv_heads, q.shape[1] // num_kv_heads, use_fn)
        decodes = plan.decodes
        kv_scales = (k_scale, v_scale)
        if decodes is not None and decodes.rows is None:  # decode-only step: no scatter
            return self._decode(q, k_cache, v_cache, decodes, scale, kv_scales)
        out = torch.empty_like(q)
        for p in plan.prefills:
            out[p.start : p.start + p.new] = _prefill_one(
                q[p.start : p.start + p.new], k_cache, v_cache, p, scale, kv_scales
            )
        if decodes is not None:
            out[decodes.rows] = self._decode(
                q[decodes.rows], k_cache, v_cache, decodes, scale, kv_scales
            )
        return out

    # -- planning (once per step) ---------------------------------------------

    def _step_plan(
        self, meta: AttentionMetadata, num_kv_heads: int, group: int, use_fn: bool
    ) -> _StepPlan:
        last = self._plan_key
        if (
            self._plan is not None
            and last is not None
            and last[0] is meta
            and last[1:] == (num_kv_heads, group, use_fn)
        ):
            return self._plan
        device = meta.slot_mapping.device
        decode_seqs: list[int] = []
        decode_rows: list[int] = []
        prefills: list[_PrefillPlan] = []
        start = 0
        for s, (new, ctx) in enumerate(
            zip(meta.host_query_lens, meta.host_context_lens, strict=True)
        ):
            if new == 1:
                decode_seqs.append(s)
                decode_rows.append(start)
            else:
                prefills.append(
                    _prefill_plan(meta.block_tables[s], start, new, ctx, meta.block_size, group)
                )
            start += new
        decodes = None
        if decode_seqs:
            if len(decode_seqs) == meta.num_seqs:
                rows, tables, lens = None, meta.block_tables, meta.context_lens
            else:
                seqs = torch.tensor(decode_seqs, dtype=torch.long, device=device)
                rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
                tables, lens = meta.block_tables[seqs], meta.context_lens[seqs]
            max_len = max(meta.host_context_lens[s] for s in decode_seqs)
            gather = None
            if not use_fn:
                gather = _decode_plan(tables, lens, max_len, meta.block_size, num_kv_heads, group)
            decodes = _DecodeGroup(rows, tables, lens, max_len, gather)
        self._plan = _StepPlan(decodes, tuple(prefills))
        self._plan_key = (meta, num_kv_heads, group, use_fn)
        return self._plan

    # -- decode -----------------------------------------------------------------

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        decodes: _DecodeGroup,
        scale: float,
        kv_scales: tuple[float, float],
    ) -> torch.Tensor:
        if decodes.plan is None:
            assert self.decode_fn is not None
            return self.decode_fn(
                q,
                k_cache,
                v_cache,
                decodes.block_tables,
                decodes.context_lens,
                decodes.max_context_len,
                scale,
                *kv_scales,
            )
        dp = decodes.plan
        assert dp is not None
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_q_heads // num_kv_heads
        keys = self._buffer(dp.key_rows.shape[0], head_dim, k_cache)
        torch.index_select(k_cache.reshape(-1, head_dim), 0, dp.key_rows, out=keys)
        fp8 = is_fp8(k_cache.dtype)
        if fp8:
            keys = dequantize(keys, kv_scales[0], q.dtype)
        keys = keys.view(batch, num_kv_heads, dp.length, head_dim)
        # GQA without repeating K: the `group` query heads sharing a kv head are
        # that kv head's query rows. Query head h reads kv head h // group.
        qg = q.view(batch, num_kv_heads, group, head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(scale).add_(dp.bias)
        if fp8:
            values = dequantize(
                v_cache.reshape(-1, head_dim).index_select(0, dp.key_rows), kv_scales[1], q.dtype
            )
            probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [b, Hkv, G, L]
            out = torch.matmul(probs, values.view(batch, num_kv_heads, dp.length, head_dim))
            return out.view(batch, num_q_heads, head_dim)
        probs = torch.softmax(scores, dim=-1).to(v_cache.dtype).view(batch * num_q_heads, dp.length)
        out = F.embedding_bag(
            dp.value_bags, v_cache.reshape(-1, head_dim), per_sample_weights=probs, mode="sum"
        )
        return out.view(batch, num_q_heads, head_dim).to(q.dtype)

    def _buffer(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        # A reused buffer: fresh multi-MB allocations each layer cost page faults
        # that, in VMs especially, take longer than the gather itself.
        buf = self._key_buffer
        if (
            buf is None
            or buf.dtype != like.dtype
            or buf.device != like.device
            or buf.numel() < rows * cols
        ):
            buf = self._key_buffer = torch.empty(rows * cols, dtype=like.dtype, device=like.device)
        return buf[: rows * cols].view(rows, cols)


def _prefill_plan(
    block_table: torch.Tensor, start: int, new: int, ctx: int, block_size: int, group: int
) -> _PrefillPlan:
    pos = torch.arange(ctx, device=block_table.device)
    slots = block_table[pos // block_size].to(torch.int64) * block_size + pos % block_size
    q_pos = torch.arange(ctx - new, ctx, device=block_table.device)
    mask = (pos[None, :] <= q_pos[:, None]).repeat(group, 1)
    return _PrefillPlan(start, new, slots, mask)


def _prefill_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _PrefillPlan,
    scale: float,
    kv_scales: tuple[float, float],
) -> torch.Tensor:
    """One sequence's n new queries [n, Hq, D] over its whole context."""
    new, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k = k_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, plan.slots)
    v = v_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, plan.slots)
    if is_fp8(k_cache.dtype):
        k, v = dequantize(k, kv_scales[0], q.dtype), dequantize(v, kv_scales[1], q.dtype)
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    # [n, Hkv*G, D] -> [Hkv, G*n, D]: row g*n + i is query i of head kv*G + g.
    qg = (
        q.view(new, num_kv_heads, group, head_dim)
        .permute(1, 2, 0, 3)
        .reshape(num_kv_heads, group * new, head_dim)
    )
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.mask, scale=scale)
    return (
        out.view(num_kv_heads, group, new, head_dim)
        .permute(2, 0, 1, 3)
        .reshape(new, num_q_heads, head_dim)
    )
