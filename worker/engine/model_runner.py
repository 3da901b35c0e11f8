"""The model runner: the model, its KV pool, one forward pass per step.

`execute(batch)` applies the step's copy-on-write block copies, builds the
flat input ids and the attention metadata of every scheduled token (prefill
chunks and decodes mixed), runs the model once, and samples a token for each
sequence whose last known token was computed this step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from worker.attention import AttentionMetadata
from worker.engine.config import EngineConfig
from worker.engine.sampling import sample
from worker.engine.scheduler import Batch
from worker.engine.sequence import Sequence
from worker.kv_pool import KVPool
from worker.model.loaded import LoadedModel
from worker.model.loader import resolve_dtype


class SampledToken(NamedTuple):
    seq: Sequence
    token_id: int


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded.model
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        mc = loaded.config
        dtype = resolve_dtype(config.dtype, self.device)
        if config.num_blocks is not None:
            self.kv_pool = KVPool(mc.num_layers, config.num_blocks, config.block_size,
                                  mc.num_kv_heads, mc.head_dim, dtype, self.device)
        else:
            self.kv_pool = KVPool.from_budget(config.kv_cache_memory or "512MiB", mc.num_layers,
                                              config.block_size, mc.num_kv_heads, mc.head_dim,
                                              dtype, self.device)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> list[SampledToken]:
        """Compute the K/V of every scheduled token; one sampled token per
        sequence that reached its last known token."""
        if batch.copies:
            self.kv_pool.copy_blocks(batch.copies)
        entries = batch.entries
        input_ids = torch.tensor(
            [t for e in entries for t in e.seq.token_ids[e.num_computed : e.num_computed + e.num_new]],
            dtype=torch.int64, device=self.device,
        )
        meta = AttentionMetadata.build(
            [(e.seq.block_table, e.num_computed, e.num_new) for e in entries],
            self.block_size, self.device,
        )
        hidden = self.model(input_ids, meta.positions(), self.kv_pool, meta)
        sampling = [i for i, e in enumerate(entries) if e.samples]
        if not sampling:
            return []
        rows = meta.last_token_indices()[sampling]
        logits = self.model.compute_logits(hidden[rows])
        seqs = [entries[i].seq for i in sampling]
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        return [SampledToken(seq, tok) for seq, tok in zip(seqs, tokens, strict=True)]
