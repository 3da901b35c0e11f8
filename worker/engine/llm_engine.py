"""The engine: requests in, outputs out, over a scheduler, a model runner and
an output processor.

`LLMEngine.step()` is one iteration of continuous batching: the scheduler
plans it (one allocator Step call), the model runner computes every
scheduled token at once and samples the sequences that reached their last
token, the output processor checks stops and detokenizes. With async
scheduling the next call is planned and sent while a step computes; on a
device whose launch returns at once (`sim:`) steps overlap (`_step`;
docs/architecture.md, "Overlapped steps"). `generate()` is the offline API;
`AsyncLLMEngine` (async_engine.py) the streaming one. A request with `n > 1`
is n sequences under one request id (`index` 0..n-1): sample 0 computes the
prompt, the others are forked from it (scheduler.py).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import abc
from collections.abc import Callable

import torch

from allocator_service.client import (
    AllocatorClient,
    AllocatorUnavailable,
    PoolLost,
    PoolSpec,
    connect,
)
from allocator_service.core import InvalidArgument, PoolConfig, check_cache_salt
from worker.engine.busy import BusyMeter
from worker.engine.config import EngineConfig
from worker.engine.model_runner import ModelRunner, SampledToken
from worker.engine.output_processor import OutputProcessor, RequestOutput
from worker.engine.sampling import SamplingError, SamplingParams, make_generator
from worker.engine.scheduler import Scheduler, StepBatch
from worker.engine.sequence import Sequence, Status, kv_in_use
from worker.engine.sim_runner import SimRunner
from worker.engine.tiers import EngineTiers, swap_slots_for
from worker.metrics import WorkerMetrics
from worker.sim import is_sim
from worker.tiers import KVLayout

log = logging.getLogger("pagedkv.worker")


class RequestError(ValueError):
    """A request the engine can never serve (too long, bad parameters);
    `param`: the request field at fault, as the API's error names it."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def prompt_logprobs_salt() -> str:
    """The cache salt of a request that asks for prompt logprobs: unique, so
    its admissions find no cached block (every prompt position is computed,
    as vLLM skips the prefix cache for such requests) and its blocks stay out
    of other requests' reach. A recompute after preemption may find its OWN
    blocks again: their positions' logprobs were taken when first computed.
    The request's own `cache_salt` adds nothing to a salt nobody else has."""
    return f"prompt-logprobs/{uuid.uuid4().hex}"


class LLMEngine:
    def __init__(
        self,
        loaded,
        config: EngineConfig,
        allocator: AllocatorClient | Callable[[PoolSpec], AllocatorClient] | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.config = config
        self.loaded = loaded
        self._probing = False  # an idle probe of the allocator is in flight
        self.tokenizer = loaded.tokenizer
        self.simulated = is_sim(config.device)
        self.runner = SimRunner(loaded, config) if self.simulated else ModelRunner(loaded, config)
        self.kv_pool = self.runner.kv_pool
        # The engine's clock: arrivals, latencies and
        # metrics read it (a virtual one on a sim: device).
        self.clock = self.runner.clock
        self.busy = self.runner.busy = BusyMeter(self.clock.now)
        self.device = self.runner.device
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.metrics = metrics or WorkerMetrics(
            config.worker_id, config.model, model_name=config.served_model_name
        )
        host, swap_slots, layout = None, 0, None
        if config.enable_prefix_caching:  # (the tiers keep blocks by their hash)
            layout = KVLayout.of_pool(self.kv_pool, loaded.fingerprint)
            if config.kv_offloading_size:
                host = self.runner.host_tier(config.kv_offloading_size, self.metrics.tier("host"))
        if host is not None and config.preemption_mode == "swap":
            swap_slots = swap_slots_for(host.num_slots)
            if not swap_slots:
                raise ValueError(
                    f"--kv-offloading-size {config.kv_offloading_size:g} GiB holds "
                    f"{host.num_slots} block(s): too few for --preemption-mode swap"
                )
        tiers = (
            None
            if layout is None
            else EngineTiers(
                self.kv_pool,
                layout,
                host,
                self.metrics,
                swap_slots=swap_slots,
                store_mover=self.runner.store_mover,
            )
        )
        spec = PoolSpec(
            config.worker_id,
            PoolConfig(
                num_blocks=self.kv_pool.num_blocks,
                block_size=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                model_fingerprint=loaded.fingerprint,
                host_blocks=tiers.host_blocks if tiers is not None else 0,
                layout=layout.key if layout is not None else "",
                block_bytes=layout.block_bytes if layout is not None else 0,
                use_shared_store=tiers is not None and config.kv_shared_store,
                kv_role=config.kv_role,
            ),
            advertise_url=config.advertise_url,
            served_model_name=config.served_model_name or config.model,
        )
        if allocator is None:
            options = {}
            if config.allocator != "embedded":
                options = {
                    "auth_token": config.allocator_token,
                    "tls_ca": config.allocator_tls_ca,
                    "on_unavailable": self._allocator_unavailable,
                }
            allocator = connect(config.allocator, spec, **options)
        elif not isinstance(allocator, AllocatorClient):
            # a factory of the client, given the pool's spec
            allocator = allocator(spec)
        self.allocator = allocator
        if tiers is not None:
            if allocator.spec.config.use_shared_store and allocator.shared_store:
                try:
                    tiers.open_store(
                        allocator.shared_store,
                        allocator.store_namespace,
                        config.kv_store_key,
                        own_url=config.advertise_url,
                        peer_key=allocator.peer_key,
                        capacity=allocator.peer_store_bytes,
                        pull_timeout_s=config.kv_peer_pull_timeout_s,
                    )
                except ValueError:  # the store's URL cannot be used here: no pool left behind
                    allocator.close()
                    raise
            if tiers.host is None and tiers.store is None:
                tiers = None  # no tier below the pool: nothing to do per step
        self.tiers = tiers
        self.runner.tiers = tiers
        self.metrics.watch_pool(
            self.allocator.stats,
            self.kv_pool.bytes_total,
            str(self.kv_pool.dtype).removeprefix("torch."),
            config.kv_role,
        )
        self.metrics.threads.set_function(torch.get_num_threads)
        self.metrics.device_busy.set_function(self.busy.ratio)
        self.metrics.device_busy_seconds.set_function(self.busy.computed)
        self.scheduler = Scheduler(
            allocator,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            on_preempt=lambda seq, cause: self.metrics.preempted(cause),
            async_scheduling=config.async_scheduling,
            lookahead=config.num_lookahead_slots,
            reservation=config.kv_reservation,
            most_slots=self.prompt_limit,
        )
        # summed at scrape time, not per step
        self.metrics.slots_ahead.set_function(self.scheduler.slots_ahead)
        # The allocator away: the step is sent again until answered (a stall, not an error).
        self.scheduler.calls.on_stall = self.metrics.allocator_unavailable_seconds.inc
        self.scheduler.tiers = tiers
        self.output_processor = OutputProcessor(
            loaded.tokenizer, loaded.eos_token_ids, self.max_model_len
        )
        self._seqs: dict[str, list[Sequence]] = {}  # request id -> its samples
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.remote_allocator = config.allocator != "embedded"
        # A device whose launch returns at once (sim:), with async scheduling:
        # each step is launched before the outputs of the one in flight are
        # processed (`_step`); that step and its batch until then.
        self.overlapped = self.runner.asynchronous and config.async_scheduling
        self._launched: tuple[StepBatch, object] | None = None

    @property
    def health(self):
        """Whether the allocator answers (AllocatorHealth: read from any thread)."""
        return self.scheduler.calls.health

    def probe_allocator(self) -> None:
        """Ask the allocator for the pool's stats, to learn while idle whether it
        still answers (and, if it dropped the pool, to register a new one).
        Engine thread only; not counted as a stall in the metrics."""
        health = self.health
        health.call_started()
        self._probing = True
        try:
            self.allocator.stats()
        except AllocatorUnavailable:
            health.unanswered()
            return
        except PoolLost:  # registered afresh; nothing is running, so nothing to recompute
            if self.tiers is not None:
                self.tiers.pool_lost(self.allocator)
        except Exception as exc:  # noqa: BLE001 - a refusal: /health says so until an answer
            health.refused(exc)
            return
        finally:
            self._probing = False
        health.answered()

    # -------------------------------------------------------------- requests
    @property
    def pool_tokens(self) -> int:
        return self.kv_pool.tokens_capacity

    def add_request(
        self,
        prompt: str | abc.Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        salt = params.cache_salt
        # The allocator's rule, checked here so a bad salt is a 400 and never
        # a refused operation (the request would wait) or a failed step.
        try:
            check_cache_salt(salt)
        except InvalidArgument as exc:
            raise RequestError(str(exc), param="cache_salt") from None
        if isinstance(prompt, str):
            prompt_ids = self.encode_prompt(prompt)
        else:
            prompt_ids = list(prompt)
            vocab = self.loaded.config.vocab_size
            if any(type(t) is not int or not 0 <= t < vocab for t in prompt_ids):
                raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if self.simulated and (params.logprobs is not None or params.prompt_logprobs is not None):
            raise RequestError(
                "a simulated device computes no logits: logprobs are not available",
                param="logprobs" if params.logprobs is not None else "prompt_logprobs",
            )
        limit = self.prompt_limit
        if len(prompt_ids) >= limit:
            raise self._too_long(f"{len(prompt_ids)}")
        room = limit - len(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestError(
                f"max_tokens {params.max_tokens} + {len(prompt_ids)} prompt tokens exceeds the "
                f"limit of {limit} tokens"
            )
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise RequestError(f"request id {rid!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise RequestError(
                f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs}): "
                "the samples of a request run together"
            )
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            # Every prompt position's logits are needed, so no prefix-cache hit
            # may skip one: a salt of its own (see `prompt_logprobs_salt`).
            salt = prompt_logprobs_salt()
            prompt_logprobs = [None]
        seq = Sequence(
            request_id=rid,
            prompt_token_ids=prompt_ids,
            params=params,
            max_tokens=params.max_tokens or room,
            arrival_time=self.clock.now(),
            generator=make_generator(params, self.device),
            prompt_logprobs=prompt_logprobs,
            cache_salt=salt,
        )
        for i in range(1, params.n):
            child_params = params.for_sample(i)
            seq.children.append(
                Sequence(
                    request_id=rid,
                    prompt_token_ids=prompt_ids,
                    params=child_params,
                    max_tokens=seq.max_tokens,
                    arrival_time=seq.arrival_time,
                    generator=make_generator(child_params, self.device),
                    index=i,
                    fork_parent=seq,
                    prompt_logprobs=prompt_logprobs,
                    cache_salt=salt,
                )
            )
        self._seqs[rid] = [seq, *seq.children]
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return rid

    @property
    def prompt_limit(self) -> int:
        """A prompt must have fewer tokens than this (context length or pool)."""
        return min(self.max_model_len, self.pool_tokens)

    def _too_long(self, count: str) -> RequestError:
        which = "context length" if self.max_model_len <= self.pool_tokens else "KV pool"
        return RequestError(
            f"the prompt has {count} tokens; the {which} holds "
            f"{self.prompt_limit}, leaving no room to generate"
        )

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, or RequestError. A text that must have
        too many tokens (the tokenizer's lower bound says so) is refused
        without tokenizing it: a multi-megabyte prompt costs nothing.
        Any thread may call it (the server tokenizes off the event loop and
        off the engine thread)."""
        at_least = self.tokenizer.min_tokens(text)
        if at_least >= self.prompt_limit:
            raise self._too_long(f"at least {at_least}")
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - e.g. a lone surrogate: the request's fault
            raise RequestError(f"cannot tokenize the prompt: {exc}") from None

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the next step."""
        for seq in self._seqs.pop(request_id, ()):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self.metrics.finished("abort")

    def has_unfinished(self) -> bool:
        return self._launched is not None or self.scheduler.has_work()

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ step
    def _allocator_unavailable(self, seconds: float, failed: int) -> None:
        if self._probing:
            return  # an idle probe: no request waited
        self.metrics.allocator_retries.inc(failed)
        self.metrics.allocator_unavailable_seconds.inc(seconds)

    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        except Exception:
            self.metrics.step_errors.inc()
            raise

    def _step(self) -> list[RequestOutput]:
        clock, scheduler, runner = self.clock, self.scheduler, self.runner
        t0, c0, waited = time.perf_counter(), clock.now(), scheduler.calls.wait_total
        batch = scheduler.schedule()
        if batch.tiered:
            # Its tier moves, now: the step before it has computed (its
            # blocks hold what they save), and the call sent next (async)
            # reports what they became. (The torch runner computes as it is
            # called: the step before it has computed. On sim: the step before
            # may be in flight: the moves are queued on the stream behind it.)
            runner.apply_tiers(batch)
        if batch.allocator_call:  # (a step computed in slots held already waited for nothing)
            self.metrics.allocator_step.observe(batch.allocator_seconds)
            self.metrics.allocator_calls.inc()
            # The high-water marks: without a call no block table grew and nobody was admitted.
            running = scheduler.running  # as this step computes them, their blocks from its call
            self.metrics.peaks.observe(*kv_in_use(running, self.block_size), len(running))
        self.num_preemptions += len(batch.preempted)
        outputs = [self._failed_output(seq) for seq in batch.failed]
        now = clock.now()
        for entry in batch.entries:  # the queue time ends at the first schedule
            if entry.seq.first_scheduled_time is None:
                entry.seq.first_scheduled_time = now
        if self.overlapped:
            # This step is queued on the device behind the one in flight,
            # whose outputs are processed while both compute; then the next
            # step is planned and its call sent, as if this one sampled.
            launched = (batch, runner.launch(batch)) if batch.entries else None
            previous, self._launched = self._launched, launched
            planning = time.perf_counter() - t0
            if previous is not None:
                outputs += self._run(*previous)
            t1 = time.perf_counter()
            if scheduler.schedule_ahead(batch):
                self.metrics.allocator_steps_ahead.inc()
            planning += time.perf_counter() - t1
        else:
            # A runner that computes as it is called: the next step's call
            # (async) goes out first and runs while this one computes.
            if scheduler.async_scheduling and scheduler.schedule_ahead(batch):
                self.metrics.allocator_steps_ahead.inc()
            planning = time.perf_counter() - t0
            if batch.entries:
                outputs += self._run(batch, runner.launch(batch))
        waited = scheduler.calls.wait_total - waited
        host = self.metrics.step_host
        host["schedule"].observe(max(0.0, planning - waited))
        host["allocator_wait"].observe(waited)
        self.metrics.running.set(len(scheduler.running))
        self.metrics.waiting.set(len(scheduler.waiting))
        self.metrics.step_time.observe(clock.now() - c0)
        return outputs

    def _run(self, batch: StepBatch, launched) -> list[RequestOutput]:
        """Wait for a launched step's outputs, draw its tokens and turn them into outputs."""
        runner, host = self.runner, self.metrics.step_host
        runner.wait(launched)
        t0 = time.perf_counter()
        sampled = runner.collect(launched)
        t1 = time.perf_counter()
        host["sample"].observe(t1 - t0)
        if batch.queried_tokens:  # (after it computed: a tier load refused is not a hit)
            self.metrics.prefix_queried.inc(batch.queried_tokens)
            self.metrics.prefix_hit.inc(batch.cached_tokens)
        now = self.clock.now()
        for s in sampled:
            if s.seq.fork_parent is not None:  # first token of a sample: forked next step
                self.scheduler.add_fork(s.seq)
        # A sequence that finished while its step was planned ahead or
        # launched (an abort; overlapped, a stop found in the step before)
        # was computed all the same: what it sampled is dropped.
        outputs = [self._append_token(s, now) for s in sampled if not s.seq.is_finished]
        self.metrics.generation_tokens.inc(len(outputs))
        host["output"].observe(time.perf_counter() - t1)
        return outputs

    def _append_token(self, sampled: SampledToken, now: float) -> RequestOutput:
        seq, tok = sampled.seq, sampled.token_id
        seq.token_ids.append(tok)
        if seq.logprobs is not None and sampled.logprobs is not None:
            seq.logprobs.append(sampled.logprobs)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.ttft.observe(now - seq.arrival_time)
        elif seq.last_token_time is not None:
            self.metrics.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now
        out = self.output_processor.process(seq, tok)
        if out.finished:
            self.scheduler.finish(seq, out.finish_reason)
            self.metrics.finished(out.finish_reason)
            if out.finish_reason in ("stop", "length") and seq.first_scheduled_time is not None:
                self.metrics.request_done(
                    seq.num_prompt_tokens,
                    seq.num_output_tokens,
                    seq.arrival_time,
                    seq.first_scheduled_time,
                    seq.first_token_time,
                    now,
                )
            out.request_finished = self._all_finished(seq.request_id)
        return out

    def _all_finished(self, request_id: str) -> bool:
        """Whether every sample of the request has finished (then forget it)."""
        family = self._seqs.get(request_id, ())
        if all(s.is_finished for s in family):
            self._seqs.pop(request_id, None)
            return True
        return False

    def _failed_output(self, seq: Sequence) -> RequestOutput:
        """A refused admission fails the whole request (its samples never ran)."""
        self.metrics.finished("error")
        for other in self._seqs.get(seq.request_id, ()):
            if not other.is_finished:
                self.scheduler.finish(other, "error")
        out = self.output_processor.failed(seq)
        out.request_finished = self._all_finished(seq.request_id)
        return out

    # --------------------------------------------------------------- offline
    def generate(
        self,
        prompts: abc.Sequence[str | abc.Sequence[int]],
        params: SamplingParams | abc.Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order (sample 0
        of each: `generate_samples` gives all n)."""
        return [samples[0] for samples in self.generate_samples(prompts, params)]

    def generate_samples(
        self,
        prompts: abc.Sequence[str | abc.Sequence[int]],
        params: SamplingParams | abc.Sequence[SamplingParams] | None = None,
    ) -> list[list[RequestOutput]]:
        """Run every prompt to completion; per prompt, its n samples' outputs by index."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        final: dict[tuple[str, int], RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id, out.index] = out
        return [[final[i, k] for k in range(sp.n)] for i, sp in zip(ids, params, strict=True)]

    def close(self) -> None:
        self.scheduler.close()
        self.allocator.close()


__all__ = [
    "EngineConfig",
    "LLMEngine",
    "RequestError",
    "RequestOutput",
    "SamplingError",
    "SamplingParams",
    "Status",
]
