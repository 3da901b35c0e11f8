"""The engine stalls, never fails, while the allocator does not answer.

`StepCalls.send` sends a step that raised `AllocatorUnavailable` again, the
same operations, until it is answered, and `GrpcAllocator` reuses the step id
of an unanswered step, so the server (which applies a step id once) never
applies it twice. Here the engine runs in this process against a REAL
allocator process that is frozen (SIGSTOP: attempts time out and queue up, to
be answered all at once after SIGCONT) and killed -9 and restarted from its
Redis journal; the client retries only once, so the scheduler's own loop is
what rides over the faults. Greedy outputs equal a fault-free run's, the
pool is intact and empty at the end, and the metrics count the stall.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import threading
import time

import pytest

from allocator_service.client import AllocatorUnavailable, EmbeddedAllocator, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import PoolConfig
from tests.support.allocator import as_json
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.model.loader import load_model

GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
CONFIG = dict(num_blocks=24, block_size=4, enable_prefix_caching=True)  # small: preemptions


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    system = [rng.randrange(3, 300) for _ in range(9)]
    return [system + [rng.randrange(3, 300) for _ in range(rng.randint(2, 20))] for _ in range(6)]


@pytest.fixture(scope="module")
def reference(tiny, prompts):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=512, block_size=4))
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


def sample(engine: LLMEngine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name, engine.metrics.labels) or 0.0


def drain(engine: LLMEngine, prompts) -> list[list[int]]:
    outs = engine.generate(prompts, GREEDY)
    engine.step()  # the frees of the last finished requests
    return [o.token_ids for o in outs]


class Flaky(EmbeddedAllocator):
    """Of every five attempts, the first two fail with AllocatorUnavailable
    (nothing applied); records the operations of every attempt."""

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        self.attempts: list[list] = []
        self.failed: list[int] = []

    def step(self, ops):
        self.attempts.append(list(ops))
        if len(self.attempts) % 5 in (1, 2):
            self.failed.append(len(self.attempts) - 1)
            raise AllocatorUnavailable("flaky")
        return super().step(ops)


def test_scheduler_resends_the_same_step_until_answered(tiny, prompts, reference):
    spec = PoolSpec("flaky", PoolConfig(CONFIG["num_blocks"], 4, True, tiny.fingerprint))
    flaky = Flaky(spec)
    engine = LLMEngine(tiny, EngineConfig(**CONFIG), allocator=flaky)
    engine.scheduler.calls.stall_backoff_s = (0.001, 0.002)
    assert drain(engine, prompts) == reference
    assert engine.num_preemptions > 0
    # every failed attempt was followed by the very same operations
    assert len(flaky.failed) > 4
    assert all(flaky.attempts[i + 1] == flaky.attempts[i] for i in flaky.failed)
    assert flaky.stats().used_blocks == 0 and flaky.pool.integrity_problems() == []
    assert sample(engine, "pagedkv_worker_allocator_unavailable_seconds_total") > 0
    assert sample(engine, "pagedkv_worker_step_errors_total") == 0


class Recording(GrpcAllocator):
    """Keeps the operations and results of every answered step."""

    accepted: list

    def step(self, ops):
        results = super().step(ops)
        # a copy: an Admit's token list is the sequence's own, which grows
        self.accepted.append((copy.deepcopy(list(ops)), results))
        return results


def test_frozen_then_killed_allocator_with_redis_state(
    tiny, prompts, reference, allocator_server, redis_store
):
    with redis_store() as (url, _):
        every = {"PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "7"}
        server = allocator_server("--state", url, env=every)
        spec = PoolSpec("stall", PoolConfig(CONFIG["num_blocks"], 4, True, tiny.fingerprint))
        holder: dict = {}

        def on_unavailable(seconds: float, failed: int) -> None:
            holder["engine"]._allocator_unavailable(seconds, failed)

        client = Recording(
            server.address,
            spec,
            deadline_s=0.3,
            retries=1,
            backoff_s=0.01,
            on_unavailable=on_unavailable,
        )
        client.accepted = []
        engine = LLMEngine(tiny, EngineConfig(**CONFIG), allocator=client)
        holder["engine"] = engine
        engine.scheduler.calls.stall_backoff_s = (0.02, 0.2)
        stalls: list[float] = []
        engine.scheduler.calls.on_stall = stalls.append  # the scheduler's own loop re-sent a step
        done = threading.Event()
        faults: list[str] = []

        def fault() -> None:
            """Freeze the allocator, thaw it; later kill -9 it and restart it."""
            while (
                sample(engine, "pagedkv_worker_generation_tokens_total") < 6 and not done.is_set()
            ):
                time.sleep(0.01)
            os.kill(server.proc.pid, signal.SIGSTOP)
            time.sleep(1.0)
            os.kill(server.proc.pid, signal.SIGCONT)
            faults.append("stop")
            while (
                sample(engine, "pagedkv_worker_generation_tokens_total") < 30 and not done.is_set()
            ):
                time.sleep(0.01)
            server.kill()
            time.sleep(0.5)
            holder["server"] = allocator_server(
                "--state", url, env=every, listen=f"127.0.0.1:{server.port}"
            )
            faults.append("kill")

        t = threading.Thread(target=fault, daemon=True)
        t.start()
        try:
            outputs = drain(engine, prompts)
            done.set()
            t.join(30)
            assert faults == ["stop", "kill"], "the workload ended before both faults"
            assert outputs == reference
            assert client.pool_id == "stall/1"  # the pool survived both faults: nothing recomputed
            assert client.stats().used_blocks == 0 and client.integrity_problems() == []
            assert stalls, (
                "the client's retries covered the faults: the scheduler's loop was not exercised"
            )
            # Each answered step was applied exactly once, in order: the same
            # answers and the same final state as the in-process core.
            core = EmbeddedAllocator(spec)
            for ops, results in client.accepted:
                assert core.step(ops) == results
            assert client.dump() == as_json(core.pool.to_state())
            assert sample(engine, "pagedkv_worker_allocator_retries_total") > 0
            # frozen 1 s
            assert sample(engine, "pagedkv_worker_allocator_unavailable_seconds_total") > 0.5
            assert sample(engine, "pagedkv_worker_step_errors_total") == 0
        finally:
            done.set()
            client.close()
            holder.get("server", server).terminate()
            server.kill()
