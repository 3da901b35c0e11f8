"""The model runner: the model, its KV pool, one forward pass per step.

`execute(batch)` applies the step's copy-on-write block copies (with KV
tiers, `apply_tiers` applied them among the tiers' moves already), builds the
flat input ids and the attention metadata of every scheduled token (prefill
chunks and decodes mixed), runs the model once, and samples a token for each
sequence whose last known token was computed this step. A sequence that
computed its last prompt token draws the first token of each of its other
samples (n > 1) from the same row of logits: the prompt is computed once.
A sequence that asks for prompt logprobs also gets the logits of every prompt
position computed this step (`_prompt_logprobs`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from worker.attention import AttentionMetadata, check_kv_dtype
from worker.engine.config import EngineConfig
from worker.engine.sampling import Logprobs, logprobs_of, sample
from worker.engine.scheduler import ScheduledSeq, StepBatch
from worker.engine.sequence import Sequence
from worker.engine.tiers import EngineTiers
from worker.kv_bytes import kv_cache_element
from worker.kv_pool import KVPool
from worker.model.loaded import LoadedModel
from worker.model.loader import resolve_dtype
from worker.sim import WallClock
from worker.tiers import HostMemory, StoreMover, TierMeter

PROMPT_LOGITS_ROWS = 256  # prompt positions whose logits are computed at once (prompt logprobs)


class SampledToken(NamedTuple):
    seq: Sequence
    token_id: int
    logprobs: Logprobs | None = None


class ModelRunner:
    # The forward pass computes as it is called (on CUDA, `collect` would wait for it
    # anyway): the engine sends the next step's allocator call before it.
    asynchronous = False

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.clock = WallClock()
        self.busy = None  # the engine's BusyMeter: each step's device time
        self.model = loaded.model
        self.stop_ids = frozenset(loaded.eos_token_ids)
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        mc = loaded.config
        model_dtype = resolve_dtype(config.dtype, self.device)
        dtype = getattr(
            torch, kv_cache_element(config.kv_cache_dtype, str(model_dtype).removeprefix("torch."))
        )
        check_kv_dtype(self.model.attn_backend, dtype, self.device)
        prepare = getattr(self.model.attn_backend, "prepare", None)
        if dtype != model_dtype and prepare is not None:
            # the model's own dtype was prepared at load
            prepare(model_dtype, dtype)
        if config.num_blocks is not None:
            self.kv_pool = KVPool(
                mc.num_layers,
                config.num_blocks,
                config.block_size,
                mc.num_kv_heads,
                mc.head_dim,
                dtype,
                self.device,
            )
        else:
            self.kv_pool = KVPool.from_budget(
                config.kv_cache_memory or "512MiB",
                mc.num_layers,
                config.block_size,
                mc.num_kv_heads,
                mc.head_dim,
                dtype,
                self.device,
            )
        self.tiers: EngineTiers | None = None  # the KV tiers below the pool (set by the engine)

    # The tiers' byte movers on this device (the engine builds its tiers with them).
    store_mover = StoreMover

    def host_tier(self, size_gib: float, meter: TierMeter) -> HostMemory | None:
        """The host tier `--kv-offloading-size GIB` asks for
        (None for 0), in this machine's memory."""
        return HostMemory.from_size(self.kv_pool, size_gib, meter=meter)

    @torch.inference_mode()
    def apply_tiers(self, batch: StepBatch) -> None:
        """Apply the step's tier moves, and its copy-on-write copies among
        them (worker/engine/tiers.py), once the step before it computed."""
        self.tiers.apply(batch, self.kv_pool.copy_blocks)  # type: ignore[union-attr]
        batch.copies = []

    def launch(self, batch: StepBatch) -> list[SampledToken]:
        """Compute the step (`execute`); its device time goes to `busy`: on CUDA
        between two events around it, elsewhere the call's own time."""
        cuda = self.device.type == "cuda"
        if cuda:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        start = self.clock.now()
        sampled = self.execute(batch)  # (sampling reads the tokens back: the step has finished)
        end = self.clock.now()
        if self.busy is not None:
            if cuda:
                events[1].record()
                events[1].synchronize()
                start = end - events[0].elapsed_time(events[1]) / 1e3
            self.busy.record(start, end)
        return sampled

    def wait(self, launched: list[SampledToken]) -> None:
        """Nothing: `launch` returned after the step computed."""

    def collect(self, launched: list[SampledToken]) -> list[SampledToken]:
        return launched

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> list[SampledToken]:
        """Compute the K/V of every scheduled token; one sampled token per
        sequence that reached its last known token."""
        if batch.copies:
            self.kv_pool.copy_blocks(batch.copies)
        entries = batch.entries
        # via NumPy: torch.tensor(list) costs about 3x as much per element, every step
        ids = [
            t for e in entries for t in e.seq.token_ids[e.num_computed : e.num_computed + e.num_new]
        ]
        input_ids = torch.from_numpy(np.array(ids, dtype=np.int64)).to(self.device)
        meta = AttentionMetadata.build(
            [(e.table, e.num_computed, e.num_new) for e in entries],
            self.block_size,
            self.device,
        )
        hidden = self.model(input_ids, meta.positions(), self.kv_pool, meta)
        self._prompt_logprobs(entries, hidden)
        sampling = [i for i, e in enumerate(entries) if e.samples]
        if not sampling:
            return []
        rows = meta.last_token_indices()[sampling]
        logits = self.model.compute_logits(hidden[rows])
        seqs = [entries[i].seq for i in sampling]
        # The other samples of a prompt computed just now: the same row each.
        forks = [(r, c) for r, s in enumerate(seqs) for c in s.unforked_samples()]
        if forks:
            logits = torch.cat([logits, logits[[r for r, _ in forks]]])
            seqs += [c for _, c in forks]
        tokens, logprobs = sample(logits, seqs, self.stop_ids)
        return [SampledToken(*t) for t in zip(seqs, tokens, logprobs, strict=True)]

    def _prompt_logprobs(self, entries: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """The logprobs of the prompt tokens of the sequences that ask for
        them, from the positions computed this step (a whole prompt or a
        chunk): the logits at position j give prompt token j + 1. Positions
        whose logprobs are known (a recompute after preemption) are skipped."""
        start = 0
        for e in entries:
            seq, first = e.seq, e.num_computed
            start, offset = start + e.num_new, start
            lps = seq.prompt_logprobs
            if lps is None:
                continue
            lo = max(first, len(lps) - 1)  # the next position whose logprobs are missing
            # the last prompt position samples
            hi = min(first + e.num_new, seq.num_prompt_tokens - 1)
            if lo >= hi:
                continue
            # A cache hit past the known positions would leave a gap (the salt prevents it).
            assert lo == len(lps) - 1, "prompt positions skipped by the prefix cache"
            # In slices: a long chunk's [tokens, vocab] float32 logits at once could take gigabytes.
            for a in range(lo, hi, PROMPT_LOGITS_ROWS):
                b = min(a + PROMPT_LOGITS_ROWS, hi)
                rows = hidden[offset + a - first : offset + b - first]
                logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
                lps.extend(
                    logprobs_of(
                        logprobs, seq.prompt_token_ids[a + 1 : b + 1], seq.params.prompt_logprobs
                    )
                )
