"""The engine: requests in, outputs out, over a scheduler, a model runner and
an output processor.

`LLMEngine.step()` is one iteration of continuous batching: the scheduler
plans it (one allocator Step call), the model runner computes every scheduled
token at once (prefill chunks and decodes mixed) and samples the sequences
that reached their last token, the output processor checks stop conditions
and detokenizes. `generate()` is the offline API on top; `AsyncLLMEngine`
(async_engine.py) the streaming one.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq

from allocator_service.client import AllocatorClient, PoolSpec, connect
from allocator_service.core import PoolConfig
from allocator_service.core.limits import MAX_SALT_LEN
from worker.engine.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.engine.output_processor import OutputProcessor, RequestOutput
from worker.engine.sampling import SamplingError, SamplingParams, make_generator
from worker.engine.scheduler import Batch, Scheduler
from worker.engine.sequence import Sequence, Status
from worker.metrics import WorkerMetrics

log = logging.getLogger("pagedkv.worker")


class RequestError(ValueError):
    """A request the engine can never serve (too long, bad parameters)."""


class LLMEngine:
    def __init__(
        self,
        loaded,
        config: EngineConfig,
        allocator: AllocatorClient | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.runner = ModelRunner(loaded, config)
        self.kv_pool = self.runner.kv_pool
        self.device = self.runner.device
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        spec = PoolSpec(
            config.worker_id,
            PoolConfig(
                num_blocks=self.kv_pool.num_blocks,
                block_size=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                model_fingerprint=loaded.fingerprint,
            ),
        )
        self.metrics = metrics or WorkerMetrics(config.worker_id, config.model)
        if allocator is None:
            options = {}
            if config.allocator != "embedded":
                options = {"auth_token": config.allocator_token, "tls_ca": config.allocator_tls_ca,
                           "on_unavailable": self._allocator_unavailable}
            allocator = connect(config.allocator, spec, **options)
        self.allocator = allocator
        self.metrics.watch_pool(self.allocator.stats, self.kv_pool.bytes_total)
        self.scheduler = Scheduler(
            allocator, config.max_num_seqs, config.max_num_batched_tokens,
            on_preempt=lambda seq, cause: self.metrics.preempted(cause),
        )
        # The allocator away: the step is sent again until answered (a stall, not an error).
        self.scheduler.on_stall = self.metrics.allocator_unavailable_seconds.inc
        self.output_processor = OutputProcessor(loaded.tokenizer, loaded.eos_token_ids, self.max_model_len)
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0

    # -------------------------------------------------------------- requests
    @property
    def pool_tokens(self) -> int:
        return self.kv_pool.tokens_capacity

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        salt = params.cache_salt
        # The allocator refuses such a salt (an over-long one per operation: the
        # request would wait forever; a lone surrogate fails the whole step).
        if salt is not None and (len(salt) > MAX_SALT_LEN or any("\ud800" <= c <= "\udfff" for c in salt)):
            raise RequestError(f"cache_salt must be valid Unicode text of at most {MAX_SALT_LEN} characters")
        if isinstance(prompt, str):
            try:
                prompt_ids = self.tokenizer.encode(prompt)
            except Exception as exc:  # noqa: BLE001 - e.g. a lone surrogate: the request's fault
                raise RequestError(f"cannot tokenize the prompt: {exc}") from None
        else:
            prompt_ids = list(prompt)
            vocab = self.loaded.config.vocab_size
            if any(type(t) is not int or not 0 <= t < vocab for t in prompt_ids):
                raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        limit = min(self.max_model_len, self.pool_tokens)
        if len(prompt_ids) >= limit:
            which = "context length" if self.max_model_len <= self.pool_tokens else "KV pool"
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; the {which} holds {limit}, "
                "leaving no room to generate"
            )
        room = limit - len(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestError(
                f"max_tokens {params.max_tokens} + {len(prompt_ids)} prompt tokens exceeds the "
                f"limit of {limit} tokens"
            )
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise RequestError(f"request id {rid!r} is already in use")
        seq = Sequence(
            request_id=rid,
            prompt_token_ids=prompt_ids,
            params=params,
            max_tokens=params.max_tokens or room,
            generator=make_generator(params, self.device),
        )
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the next step."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self.metrics.finished("abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ step
    def _allocator_unavailable(self, seconds: float, failed: int) -> None:
        self.metrics.allocator_retries.inc(failed)
        self.metrics.allocator_unavailable_seconds.inc(seconds)

    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        except Exception:
            self.metrics.step_errors.inc()
            raise

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        self.metrics.allocator_step.observe(batch.allocator_seconds)
        self.num_preemptions += len(batch.preempted)
        if batch.queried_tokens:
            self.metrics.prefix_queried.inc(batch.queried_tokens)
            self.metrics.prefix_hit.inc(batch.cached_tokens)
        outputs = [self._failed_output(seq) for seq in batch.failed]
        if batch.entries:
            outputs += self._run(batch)
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.step_time.observe(time.perf_counter() - t0)
        return outputs

    def _run(self, batch: Batch) -> list[RequestOutput]:
        sampled = self.runner.execute(batch)
        now = time.monotonic()
        return [self._append_token(seq, tok, now) for seq, tok in sampled]

    def _append_token(self, seq: Sequence, tok: int, now: float) -> RequestOutput:
        seq.token_ids.append(tok)
        self.metrics.generation_tokens.inc()
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
            self._seqs.pop(seq.request_id, None)
        return out

    def _failed_output(self, seq: Sequence) -> RequestOutput:
        self.metrics.finished("error")
        self._seqs.pop(seq.request_id, None)
        return self.output_processor.failed(seq)

    # --------------------------------------------------------------- offline
    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def close(self) -> None:
        self.allocator.close()


__all__ = ["EngineConfig", "LLMEngine", "RequestError", "RequestOutput", "SamplingError", "SamplingParams", "Status"]
