"""This engine (`LLMEngine`) as one system of `bench serve`.

An `EngineSystem` names what varies between the engine's systems: prefix
caching, the allocator (an address from `systems.allocators.deploy`), async
scheduling, lookahead slots and the CPU attention backend. `run` hands it the
whole workload at t=0 and steps until every request is done, then reports:

- tokens/s, wall time, TTFT (t=0 until the step that sampled a request's
  first token returned), mean step time and time per output token;
- the allocator's share: calls per step and the time a step waited for it;
- KV slots, when `sample_kv`: the pool's stats read after every step (slots in
  allocated blocks vs slots holding a token, shared prefix blocks once). With
  a remote allocator that read is one more RPC per step on the loop being
  timed, so comparisons of allocators turn it off and those figures are None;
- peaks, always measured: the engine's high-water marks at every step
  (`pagedkv_worker_*_peak`: the running sequences' blocks, shared ones once,
  their slots holding a token, and running sequences), reset after warm-up;
- preemptions and prefix-cache hits (local counters and the pool's stats
  before and after: always measured).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from pagedkv.bench import harness
from pagedkv.bench.systems import Serving
from pagedkv.bench.workloads import warmup_prompts

_WORKER_IDS = itertools.count(1)  # a fresh worker id (so a fresh pool) for every run


@dataclass(frozen=True)
class EngineSystem:
    prefix_caching: bool = True
    allocator: str = "embedded"  # "embedded" or an allocator's address
    async_scheduling: bool = True
    lookahead: int = 8
    attention: str | None = None  # a CPU attention backend; None: the CPU default
    sample_kv: bool = True

    @property
    def label(self) -> str:
        return (
            "engine"
            + ("" if self.prefix_caching else " (prefix caching off)")
            + (f" [{self.attention} attention]" if self.attention else "")
        )

    def run(self, loaded, prompts: list[list[int]], serving: Serving) -> dict[str, Any]:
        """One run of the workload on a fresh pool; the figures,
        and `_outputs` (every request's tokens)."""
        from worker.attention import get_backend, select_backend
        from worker.engine import LLMEngine, SamplingParams

        # every run sets it: the systems share one loaded model
        loaded.model.attn_backend = (
            get_backend(self.attention) if self.attention else select_backend("cpu")
        )
        engine = LLMEngine(loaded, self._config(serving))
        try:
            engine.generate(
                warmup_prompts(loaded.config.vocab_size),
                SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
            )
            params = SamplingParams(max_tokens=serving.max_tokens, temperature=0.0, ignore_eos=True)
            engine.metrics.peaks.reset()  # this run's high-water marks, raised at every step
            before = _Counters.read(engine)
            trace = _Trace(time.perf_counter())
            ids = [engine.add_request(p, params, f"req-{i}") for i, p in enumerate(prompts)]
            while engine.has_unfinished():
                trace.step(engine, engine.step(), self.sample_kv)
            trace.wall = time.perf_counter() - trace.t0
            trace.peaks = engine.metrics.peaks.values()
            used = _Counters.read(engine) - before
        finally:
            engine.close()
        return self._figures(ids, trace, used, serving)

    def _config(self, serving: Serving):
        from worker.engine import EngineConfig

        return EngineConfig(
            model=serving.model,
            allocator=self.allocator,
            worker_id=f"bench-serve-{os.getpid()}-{next(_WORKER_IDS)}",
            num_blocks=serving.num_blocks,
            block_size=serving.block_size,
            enable_prefix_caching=self.prefix_caching,
            async_scheduling=self.async_scheduling,
            num_lookahead_slots=self.lookahead,
            max_num_seqs=serving.max_num_seqs,
            max_num_batched_tokens=serving.max_num_batched_tokens,
        )

    def _figures(
        self, ids: list[str], trace: _Trace, used: _Counters, serving: Serving
    ) -> dict[str, Any]:
        outputs = [trace.tokens[i] for i in ids]
        generated = sum(len(t) for t in outputs)
        steps, wall = trace.steps, trace.wall
        tpot = [
            (trace.last[i] - trace.first[i]) / (len(t) - 1)
            for i, t in zip(ids, outputs, strict=True)
            if len(t) > 1
        ]
        return {
            "system": self.label,
            "tokens_generated": generated,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(generated / wall, 2),
            **ttft_stats([trace.first[i] - trace.t0 for i in ids]),
            "mean_step_ms": round(wall / steps * 1000, 3) if steps else None,
            "tpot_ms": round(statistics.fmean(tpot) * 1000, 3) if tpot else None,
            "allocator_wait_ms_per_step": round(used.waited_s / steps * 1000, 3) if steps else None,
            "allocator_calls_per_step": round(used.calls / steps, 3) if steps else None,
            "allocator": "embedded" if self.allocator == "embedded" else "grpc",
            "async_scheduling": self.async_scheduling,
            "num_lookahead_slots": self.lookahead,
            "kv_slots_reserved": serving.slots,
            **trace.kv_figures(),
            "kv_slots_allocated_peak": trace.peaks.kv_blocks_used * serving.block_size,
            "kv_slots_holding_tokens_peak": trace.peaks.kv_slots_holding_tokens,
            "preemptions": used.preemptions,
            "steps": steps,
            "max_running_seqs": trace.peaks.running_sequences,
            "prefix_cache": self.prefix_caching,
            "ttft_method": "time from t=0 (all requests submitted) "
            "until the step that sampled the first token "
            "returned",
            "kv_method": "peaks: the engine's high-water "
            "marks at every step (pagedkv_worker_*_peak); "
            + (
                "means: allocator pool stats after every step (slots in allocated blocks vs slots "
                "holding a token, shared prefix blocks once); logical "
                "= sum of the running sequences' stored tokens"
                if self.sample_kv
                else "means not sampled (one more allocator call per step)"
            ),
            "prefix_hit_tokens": used.prefix_hit_tokens,
            "prefix_queried_tokens": used.prefix_queried_tokens,
            "_outputs": outputs,
        }


def ttft_stats(values: list[float]) -> dict[str, float | None]:
    """Mean, p50 and p90 of the requests' times to first token, in seconds."""

    def rounded(v: float | None) -> float | None:
        return None if v is None else round(v, 4)

    return {
        "ttft_mean_s": rounded(harness.mean(values)),
        "ttft_p50_s": rounded(harness.percentile(values, 0.5)),
        "ttft_p90_s": rounded(harness.percentile(values, 0.9)),
    }


@dataclass
class _Counters:
    """The engine's cumulative counters at one moment (or the difference of two readings)."""

    preemptions: int
    waited_s: float  # steps' time waiting for the allocator
    calls: float  # allocator calls
    prefix_hit_tokens: int
    prefix_queried_tokens: int

    @classmethod
    def read(cls, engine) -> _Counters:
        stats = engine.allocator.stats()
        waited = next(
            s.value
            for m in engine.metrics.allocator_step.collect()
            for s in m.samples
            if s.name.endswith("_sum")
        )
        return cls(
            engine.num_preemptions,
            waited,
            engine.metrics.allocator_calls._value.get(),
            stats.prefix_hit_tokens,
            stats.prefix_queried_tokens,
        )

    def __sub__(self, other: _Counters) -> _Counters:
        return _Counters(
            self.preemptions - other.preemptions,
            self.waited_s - other.waited_s,
            self.calls - other.calls,
            self.prefix_hit_tokens - other.prefix_hit_tokens,
            self.prefix_queried_tokens - other.prefix_queried_tokens,
        )


@dataclass
class _Trace:
    """What the step loop saw: each request's first and last token times and
    tokens, and (when sampled) the pool's KV figures after every step."""

    t0: float
    wall: float = 0.0
    steps: int = 0
    peaks: Any = None  # the engine's high-water marks over the run (`WorkerMetrics.peaks.values()`)
    first: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    allocated: list[int] | None = None  # slots in allocated blocks, per step; None: not sampled
    held: list[int] = field(default_factory=list)  # slots holding a token
    # tokens the running sequences store, shared or not
    logical: list[int] = field(default_factory=list)

    def step(self, engine, outputs, sample_kv: bool) -> None:
        now = time.perf_counter()
        self.steps += 1
        for out in outputs:
            self.first.setdefault(out.request_id, now)
            if out.finished:
                self.tokens[out.request_id] = out.token_ids
                self.last[out.request_id] = now
        running = engine.scheduler.running
        if not sample_kv:
            return
        if self.allocated is None:
            self.allocated = []
        stats = engine.allocator.stats()
        if stats.slots_allocated:
            self.allocated.append(stats.slots_allocated)
            self.held.append(stats.tokens_stored)
            self.logical.append(sum(s.num_stored for s in running))

    def kv_figures(self) -> dict[str, float | int | None]:
        allocated, held = self.allocated or [], self.held
        peak = max(allocated, default=None)
        util = [h / a for h, a in zip(held, allocated, strict=True)]
        return {
            "kv_tokens_logical_peak": max(self.logical, default=None),
            "kv_utilisation_mean": round(statistics.fmean(util), 4) if util else None,
            "kv_utilisation_peak_alloc": round(held[allocated.index(peak)] / peak, 4)
            if peak
            else None,
        }
