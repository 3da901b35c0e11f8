"""Test helpers for worker.model: a minimal greedy loop over the paged decoder.

Not an engine: every sequence gets a fixed run of sequential blocks, all
prompts are prefilled in one step, then all unfinished sequences decode together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.attention import AttentionMetadata
from worker.kv_pool import KVPool
from worker.model.llama import LlamaForCausalLM


def make_pool(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> KVPool:
    c = model.config
    return KVPool(
        c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, model.dtype, model.device
    )


def run_step(
    model: LlamaForCausalLM,
    pool: KVPool,
    seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]],
) -> torch.Tensor:
    """One forward step. seqs: (block_table, num_computed, new_token_ids).
    Returns float32 logits [T, vocab] for every new token."""
    meta = AttentionMetadata.build(
        [(t, c, len(ids)) for t, c, ids in seqs], pool.block_size, model.device
    )
    ids = torch.tensor(
        [i for _, _, new in seqs for i in new], dtype=torch.long, device=model.device
    )
    hidden = model(ids, meta.positions(), pool, meta)
    return model.compute_logits(hidden)


def greedy_generate(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    block_size: int = 16,
) -> list[list[int]]:
    """Greedy continuations (an eos token is included and ends its sequence)."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    per_seq = -(-longest // block_size)
    pool = make_pool(model, per_seq * len(prompts), block_size)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(len(prompts))]
    lengths = [len(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    # Prefill: logits only at each prompt's last token.
    meta = AttentionMetadata.build(
        [(tables[s], 0, lengths[s]) for s in range(len(prompts))], block_size, model.device
    )
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=model.device)
    hidden = model(ids, meta.positions(), pool, meta)
    next_ids = model.compute_logits(hidden[meta.last_token_indices()]).argmax(-1).tolist()
    active = list(range(len(prompts)))
    while True:
        still = []
        for s, tok in zip(active, next_ids, strict=True):
            out[s].append(tok)
            if tok not in eos_token_ids and len(out[s]) < max_new_tokens:
                still.append(s)
        active = still
        if not active:
            return out
        meta = AttentionMetadata.build(
            [(tables[s], lengths[s], 1) for s in active], block_size, model.device
        )
        ids = torch.tensor([out[s][-1] for s in active], dtype=torch.long, device=model.device)
        hidden = model(ids, meta.positions(), pool, meta)
        next_ids = model.compute_logits(hidden).argmax(-1).tolist()
        for s in active:
            lengths[s] += 1
