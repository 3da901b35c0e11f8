"""Hugging Face transformers on the engine's weights, as systems of `bench serve`.

- `run_static`: `model.generate` over batches of `batch_size` requests in
  arrival order, left-padded. TTFT: a streamer's second `put` (the first
  carries the prompt) marks the end of the batch's prefill, which is every
  member's TTFT; later batches include the time they waited for earlier
  ones. KV: the contiguous reservation, rows x (longest prompt +
  max_tokens), vs the tokens actually held, step by step. Preemptions: none
  by construction.
- `run_continuous`: `model.generate_batch` (when the installed version has
  it) with a paged cache of the same slots and per-step token budget. TTFT:
  its own per-token timestamps. KV: its cache size only (its block usage is
  not exposed, so those figures are None). Preemptions: the requests its log
  says it offloaded.
"""

from __future__ import annotations

import contextlib
import logging
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedkv.bench.systems import Serving
from pagedkv.bench.systems.engine import ttft_stats
from pagedkv.bench.workloads import warmup_prompts


def load(spec: str):
    """The transformers model of `spec` ('tiny-random', 'smollm2',
    a .gguf file or a folder), fp32, eval mode."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if spec == "tiny-random":
        return _tiny_random().eval()
    import torch
    from transformers import AutoModelForCausalLM

    if spec == "smollm2":
        from pagedkv_base.model_files import smollm2_path

        path = smollm2_path()
    else:
        path = Path(spec).expanduser()
    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    try:  # its GGUF dequantiser draws a tqdm bar of its own, ignoring the switch above
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_utils.tqdm = lambda iterable, **_: iterable
    except (ImportError, AttributeError):
        pass
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _tiny_random():
    import torch
    import transformers

    from worker.model.tiny import SEED, TINY_CONFIG, random_weights

    c = TINY_CONFIG
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    assert SEED == 0
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(dict(random_weights(c)), strict=False)
    if unexpected or any(not k.startswith("lm_head") for k in missing):
        raise RuntimeError(
            f"tiny-random weights do not fit transformers' Llama: {missing} {unexpected}"
        )
    model.tie_weights()
    return model


# -- static batching -----------------------------------------------------------------------


def _static_generate(model, batch: list[list[int]], max_tokens: int, pad_id: int, streamer=None):
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    config = GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, streamer=streamer
        )
    return out[:, width:].tolist()


def _first_token_streamer():
    """A streamer whose `first` is the time of its second put(): put #1 carries
    the prompt, #2 the first generated token of every row."""
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0
            self.first: float | None = None

        def put(self, value) -> None:
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    return FirstToken()


def run_static(model, prompts: list[list[int]], serving: Serving, pad_id: int) -> dict[str, Any]:
    _static_generate(model, warmup_prompts(model.config.vocab_size), 4, pad_id)
    T = serving.max_tokens
    outputs: list[list[int]] = []
    ttft: list[float] = []
    util: list[float] = []
    reserved_peak = held_peak = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), serving.batch_size):
        batch = prompts[start : start + serving.batch_size]
        streamer = _first_token_streamer()
        outputs.extend(_static_generate(model, batch, T, pad_id, streamer))
        ttft.extend([(streamer.first or time.perf_counter()) - t0] * len(batch))
        rows, longest, real = len(batch), max(len(p) for p in batch), sum(len(p) for p in batch)
        reserved = rows * (longest + T)  # a contiguous cache's reservation for this batch
        reserved_peak = max(reserved_peak, reserved)
        held_peak = max(held_peak, real + rows * (T - 1))
        # After producing token s (1..T) the cache holds prompt + s - 1 tokens per row.
        util.extend((real + rows * (s - 1)) / reserved for s in range(1, T + 1))
    wall = time.perf_counter() - t0
    generated = sum(len(o) for o in outputs)
    return {
        "system": f"transformers generate (static, batch {serving.batch_size})",
        "tokens_generated": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 2),
        **ttft_stats(ttft),
        "kv_slots_reserved": reserved_peak,
        "kv_slots_allocated_peak": reserved_peak,
        "kv_slots_holding_tokens_peak": held_peak,
        "kv_tokens_logical_peak": held_peak,
        "kv_utilisation_mean": round(statistics.fmean(util), 4),
        "kv_utilisation_peak_alloc": round(held_peak / reserved_peak, 4),
        "preemptions": 0,
        "ttft_method": "batches run one after another from t=0; "
        "a streamer's 2nd put() (1st generated token of "
        "every row, i.e. end of the batch's prefill) is each member's first-token time",
        "kv_method": "contiguous reservation rows x (longest "
        "prompt + max_tokens) per batch vs the real tokens "
        "held after each generated token",
        "_outputs": outputs,
    }


# -- continuous batching -------------------------------------------------------------------


class _OffloadCounter(logging.Handler):
    """Counts the requests transformers' continuous batching offloads or resets."""

    PATTERN = re.compile(r"Offloaded (\d+) requests")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        match = self.PATTERN.search(record.getMessage())
        if match:
            self.count += int(match.group(1))


@contextlib.contextmanager
def _counting_offloads() -> Iterator[_OffloadCounter]:
    """Its log says how many requests it offloads: count them, hide everything else it says."""
    counter = _OffloadCounter()
    loggers = [
        logging.getLogger(n)
        for n in ("ContinuousBatchingLogger", "transformers.generation.continuous_batching")
    ]
    saved = [(lg, lg.level) for lg in loggers]
    quiet = [(h, h.level) for lg in loggers for h in lg.handlers]
    for h, _ in quiet:
        h.setLevel(logging.ERROR)
    for lg in loggers:
        lg.addHandler(counter)
        lg.setLevel(logging.INFO)
    try:
        yield counter
    finally:
        for lg, level in saved:
            lg.removeHandler(counter)
            lg.setLevel(level)
        for h, level in quiet:
            h.setLevel(level)


def run_continuous(model, prompts: list[list[int]], serving: Serving) -> dict[str, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    def cb_config() -> ContinuousBatchingConfig:
        return ContinuousBatchingConfig(
            page_size=serving.block_size,
            num_blocks=serving.num_blocks,
            max_batch_tokens=serving.max_num_batched_tokens,
            max_requests_per_batch=serving.max_num_seqs,
        )

    gen = GenerationConfig(max_new_tokens=serving.max_tokens, do_sample=False, eos_token_id=None)
    warm = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    with _counting_offloads() as counter:
        model.generate_batch(
            warmup_prompts(model.config.vocab_size),
            generation_config=warm,
            continuous_batching_config=cb_config(),
        )
        counter.count = 0
        t0 = time.perf_counter()
        results = model.generate_batch(
            prompts,
            generation_config=gen,
            continuous_batching_config=cb_config(),
            record_timestamps=True,
        )
        wall = time.perf_counter() - t0
    ordered = list(results.values())
    if len(ordered) != len(prompts) or any(r.error for r in ordered):
        raise RuntimeError(
            f"generate_batch returned {len(ordered)} results for {len(prompts)} prompts"
        )
    outputs = [list(r.generated_tokens) for r in ordered]
    generated = sum(len(o) for o in outputs)
    ttft = [(r.timestamps[0] if r.timestamps else r.lifespan[1]) - t0 for r in ordered]
    return {
        "system": "transformers generate_batch (continuous)",
        "tokens_generated": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 2),
        **ttft_stats(ttft),
        "kv_slots_reserved": serving.slots,
        "kv_slots_allocated_peak": None,
        "kv_slots_holding_tokens_peak": None,
        "kv_tokens_logical_peak": None,
        "kv_utilisation_mean": None,
        "kv_utilisation_peak_alloc": None,
        "preemptions": counter.count,
        "ttft_method": "its own per-token timestamps (record_timestamps=True) minus t=0",
        "kv_method": "cache size only (num_blocks x page_size); its block usage is not exposed",
        "_outputs": outputs,
    }
