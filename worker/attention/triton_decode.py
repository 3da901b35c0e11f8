"""Triton paged-decode kernel: one program per (sequence, query head).

Each program walks its sequence's block table, loads one K/V block at a time
and keeps an online softmax (running max, running sum, rescaled accumulator),
so nothing of size context is ever materialised. GQA: query head h reads kv
head h // (Hq // Hkv). Only positions < context_len are loaded (masked loads
with `other=0`), so slots a sequence does not own are never read. An fp8
cache (KV_FP8) is converted to float32 as it is loaded and multiplied by the
layer's `k_scale` / `v_scale`.

Importing this module decorates the kernel, which is when Triton reads
TRITON_INTERPRET: set it before import to run the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kv_quant import is_fp8


def _paged_decode_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale,
    k_scale,
    v_scale,
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    context_len = tl.load(context_lens_ptr + seq)

    offs_n = tl.arange(0, BLOCK_N)  # slot within a block (BLOCK_N = next pow2 of BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_seq + head * stride_q_head + offs_d, mask=d_mask, other=0.0)
    q = q.to(tl.float32)

    m_i = tl.full([], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.full([], 0.0, tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    for j in range(0, num_blocks):
        # int64 before multiplying by the block stride: pools exceed 2**31 elements.
        block = tl.load(block_tables_ptr + seq * stride_bt_seq + j).to(tl.int64)
        n_mask = (offs_n < BLOCK_SIZE) & (j * BLOCK_SIZE + offs_n < context_len)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_off = block * stride_k_block + offs_n[:, None] * stride_k_slot + kv_head * stride_k_head
        k = tl.load(k_ptr + k_off + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        if KV_FP8:
            k = k * k_scale
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(n_mask, scores, float("-inf"))
        # Block 0 always holds position 0, so m_new is finite from the first step.
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        v_off = block * stride_v_block + offs_n[:, None] * stride_v_slot + kv_head * stride_v_head
        v = tl.load(v_ptr + v_off + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        if KV_FP8:
            v = v * v_scale
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    o_ptrs = out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


paged_decode_kernel = triton.jit(_paged_decode_kernel)


def kernel_constexprs(
    num_q_heads: int, num_kv_heads: int, block_size: int, head_dim: int, kv_fp8: bool = False
) -> dict[str, int]:
    """The compile-time constants of one kernel specialisation."""
    return {
        "QUERIES_PER_KV": num_q_heads // num_kv_heads,
        "BLOCK_SIZE": block_size,
        "BLOCK_N": triton.next_power_of_2(block_size),
        "HEAD_DIM": head_dim,
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "KV_FP8": int(kv_fp8),
    }


def triton_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """A `DecodeFn` (see `torch_paged`); `max_context_len` is unused (the kernel reads
    each sequence's own length), the scales only for an fp8 cache."""
    del max_context_len
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("triton_decode needs the head_dim axis contiguous")
    out = torch.empty_like(q)
    paged_decode_kernel[(batch, num_q_heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        float(k_scale),
        float(v_scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        **kernel_constexprs(num_q_heads, num_kv_heads, block_size, head_dim, is_fp8(k_cache.dtype)),
    )
    return out
