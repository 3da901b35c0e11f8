"""Fault drills on real processes (docs/architecture.md, "The block contract": durability).

Two workers serve greedy requests on pools small enough to preempt, with the
allocator's state journaled in a private Redis (append-only), while a drill
kills -9 the allocator, then Redis, then a worker. Each drill checks what the
design promises: every request (but the killed worker's) completes with the
text of a fault-free run, the workers stall rather than fail (their metrics
count the stall and no error), the pools come back as they were (no
recompute) and at the end no block is leaked (the allocator's state, rebuilt
from its journal, is intact with every block free or cached). A last drill
restarts an allocator that keeps its state in memory: the pools are lost and
every running sequence is recomputed, with the same texts.

The workers pipeline their allocator calls (async scheduling, the default):
each kill lands while a step's call is out as the previous step computes,
and the texts are those of the synchronous engine (`reference_texts`).

Figures: `python -m pytest tests/drills/test_faults.py -s` prints one
`DRILL {...}` JSON line per drill (docs/reliability.md).
"""

from __future__ import annotations

import threading
import time

import pytest

from allocator_service.client.router_client import RouterClient
from allocator_service.wire.v1 import allocator_pb2 as pb
from tests.support.drills import (
    Job,
    Stack,
    check_no_leak,
    complete,
    error_requests,
    report,
    run_jobs,
    scrape,
    wait_for,
)
from tests.support.drills import reference_texts as offline

SYSTEM = "sys: "  # a shared prefix (the tokenizer is byte-level: one token a byte)
PROMPTS = [
    SYSTEM + p
    for p in (
        "hello",
        "what is a page",
        "blocks and tables",
        "one two three",
        "quick brown fox",
        "a paged kv cache",
    )
]
MAX_TOKENS = 16
# 20 blocks of 4 = 80 token slots per worker, for 6 requests of 25 to 37
# tokens at once: the schedulers must preempt.
WORKER_ARGS = [
    "--num-blocks",
    "20",
    "--block-size",
    "4",
    "--enable-prefix-caching",
    "--max-model-len",
    "64",
]
LEASE_TTL = 3.0
# settings of the allocator that are variables only (the reference in docs/operations.md)
ALLOCATOR_ENV = {
    "PAGEDKV_ALLOCATOR_LEASE_TTL": str(LEASE_TTL),
    "PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": "25",
}
OUTAGE_S = 1.0  # how long the killed process stays down


@pytest.fixture(scope="module")
def reference():
    return offline(PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def stack():
    with Stack(2, worker_args=WORKER_ARGS, env=ALLOCATOR_ENV, redis=True) as s:
        yield s


def jobs_for(workers: list[int]) -> list[Job]:
    return [Job(w, p, stream=p % 2 == 1) for w in workers for p in range(len(PROMPTS))]


def worker_samples(stack: Stack) -> list:
    return [scrape(f"{w.url}/metrics") for w in stack.workers]


def generated(stack: Stack, workers=None) -> float:
    return sum(
        scrape(f"{stack.workers[i].url}/metrics").value("pagedkv_worker_generation_tokens_total")
        for i in (workers if workers is not None else range(len(stack.workers)))
    )


def after_some_tokens(stack: Stack, before: list, n: int = 8, workers=None) -> None:
    """Wait until the workload is well under way: n tokens generated since
    `before` (the workers' metrics read before it was sent). NOTE: counted
    from before the requests went out, not from when this starts: the
    requests start first, and a worker could finish all of its part before
    a count taken here, leaving nothing more to wait for."""
    indexes = workers if workers is not None else range(len(stack.workers))
    start = sum(before[i].value("pagedkv_worker_generation_tokens_total") for i in indexes)
    wait_for(lambda: generated(stack, workers) >= start + n, 60, f"{n} tokens to be generated")


def stall_figures(stack: Stack, before: list) -> dict:
    """Per worker: the stall its metrics show, and its errors, since `before`."""
    out = {}
    for w, b in zip(stack.workers, before, strict=True):
        a = scrape(f"{w.url}/metrics")
        out[w.worker_id] = {
            "stall_s": round(
                a.value("pagedkv_worker_allocator_unavailable_seconds_total")
                - b.value("pagedkv_worker_allocator_unavailable_seconds_total"),
                3,
            ),
            "retries": a.value("pagedkv_worker_allocator_retries_total")
            - b.value("pagedkv_worker_allocator_retries_total"),
            "step_errors": a.value("pagedkv_worker_step_errors_total")
            - b.value("pagedkv_worker_step_errors_total"),
            "failed_requests": error_requests(a) - error_requests(b),
            "preemptions": a.value("pagedkv_worker_preemptions_total")
            - b.value("pagedkv_worker_preemptions_total"),
        }
    return out


def assert_same_pools_no_recompute(stack: Stack, pools: list[str]) -> None:
    assert (
        sorted(
            stack.allocator_metrics().labels("pagedkv_allocator_pool_capacity_blocks", "pool_id")
        )
        == pools
    )
    for w in stack.workers:
        assert "was dropped" not in w.log()  # no PoolLost: nothing was recomputed for it


def restart_drill(stack: Stack, reference: list[str], name: str, kill, start) -> dict:
    """Run the workload on both workers; once it is under way, `kill()`,
    send one more request to each worker (so each has steps to make while
    the process is down, however fast the rest of the workload went), wait
    OUTAGE_S, `start()`. Every request completes with the fault-free text,
    no worker fails a step or a request, the pools are the same ones (nothing
    recomputed) and nothing leaks. Returns the per-worker figures."""
    before = worker_samples(stack)
    late_jobs = [Job(w, 0, stream=False) for w in (0, 1)]
    late: list = []

    def fault() -> dict:
        after_some_tokens(stack, before)
        t0 = time.monotonic()
        kill()
        sending = threading.Thread(
            target=lambda: late.extend(run_jobs(stack, PROMPTS, late_jobs, MAX_TOKENS)[0]),
            daemon=True,
        )
        sending.start()
        time.sleep(OUTAGE_S)
        start()
        sending.join(300)
        return {"outage_s": round(time.monotonic() - t0, 3)}

    jobs = jobs_for([0, 1])
    results, fault_figures = run_jobs(stack, PROMPTS, jobs, MAX_TOKENS, during=fault)
    results, jobs = results + late, jobs + late_jobs
    assert len(late) == len(late_jobs), "the requests sent during the outage did not finish"
    assert [r.status for r in results] == [200] * len(results), [
        r.error for r in results if r.status != 200
    ]
    assert [r.text for r in results] == [reference[j.prompt] for j in jobs]
    stack.wait_idle()
    figures = stall_figures(stack, before)
    for f in figures.values():
        assert f["step_errors"] == 0 and f["failed_requests"] == 0
    assert_same_pools_no_recompute(stack, ["worker-1/1", "worker-2/1"])
    for w in stack.workers:  # the steps were pipelined (async scheduling)
        assert scrape(f"{w.url}/metrics").value("pagedkv_worker_allocator_steps_ahead_total") > 0
    pools = check_no_leak(stack.redis.url, ["worker-1/1", "worker-2/1"])
    report(
        name,
        {
            "requests": len(results),
            "errors": 0,
            **fault_figures,
            "workers": figures,
            "pools": pools,
            "max_latency_s": round(max(r.latency_s for r in results), 3),
        },
    )
    return figures


def test_allocator_kill9_and_restart(stack, reference):
    """kill -9 the allocator mid-workload, restart it on the same port: it
    rebuilds its state from the journal and re-arms every lease."""
    figures = restart_drill(
        stack, reference, "allocator_kill9", stack.kill_allocator, stack.start_allocator
    )
    # Every worker had a request to start while the allocator was down: it
    # stalled (it never fails: restart_drill checks) and says so.
    for f in figures.values():
        assert f["retries"] > 0 and f["stall_s"] > 0


def test_redis_kill9_and_restart(stack, reference):
    """kill -9 Redis (append-only) mid-workload and start it again: the
    allocator answers UNAVAILABLE meanwhile (nothing it cannot journal is
    applied) and reloads from Redis after."""
    figures = restart_drill(stack, reference, "redis_kill9", stack.kill_redis, stack.start_redis)
    for f in figures.values():  # each worker's steps were refused while Redis was away
        assert f["retries"] > 0 and f["stall_s"] > 0


def test_worker_kill9_lease_expires_and_restart(stack, reference):
    """kill -9 worker-2 mid-workload: worker-1's requests are unaffected,
    worker-2's lease runs out and its pool is dropped; worker-2 started again
    with the same --worker-id registers a new epoch and serves."""
    router = RouterClient(stack.allocator_address, router_token=stack.router_token)
    first_event = stack.allocator_metrics().value("pagedkv_allocator_event_sequence") + 1
    before = worker_samples(stack)
    victim = stack.workers[1]

    def fault() -> dict:
        after_some_tokens(stack, before, workers=[1])
        victim.kill()
        t0 = time.monotonic()
        dropped = None
        for e in router.watch_events(from_sequence=int(first_event), timeout_s=LEASE_TTL * 4):
            if e.kind == pb.KV_EVENT_KIND_POOL_DROPPED and e.pool_id == "worker-2/1":
                dropped = e.reason
                break
        return {"pool_dropped_after_s": round(time.monotonic() - t0, 3), "drop_reason": dropped}

    jobs = jobs_for([0, 1])
    results, fault_figures = run_jobs(stack, PROMPTS, jobs, MAX_TOKENS, during=fault)
    router.close()
    assert fault_figures["drop_reason"] == "lease_expired"
    assert fault_figures["pool_dropped_after_s"] <= LEASE_TTL + 2
    survivors = [(j, r) for j, r in zip(jobs, results, strict=True) if j.worker == 0]
    assert [r.status for _, r in survivors] == [200] * len(survivors)
    assert [r.text for _, r in survivors] == [reference[j.prompt] for j, _ in survivors]
    lost = sum(r.status != 200 for j, r in zip(jobs, results, strict=True) if j.worker == 1)
    w1_before, w1_after = before[0], scrape(f"{stack.workers[0].url}/metrics")
    assert w1_after.value("pagedkv_worker_step_errors_total") == w1_before.value(
        "pagedkv_worker_step_errors_total"
    )
    assert error_requests(w1_after) == error_requests(w1_before)
    assert sorted(
        stack.allocator_metrics().labels("pagedkv_allocator_pool_capacity_blocks", "pool_id")
    ) == ["worker-1/1"]

    t0 = time.monotonic()
    victim.start().wait_healthy()
    restart_s = time.monotonic() - t0
    assert sorted(
        stack.allocator_metrics().labels("pagedkv_allocator_pool_capacity_blocks", "pool_id")
    ) == ["worker-1/1", "worker-2/2"]
    again = [complete(victim.url, PROMPTS[i], MAX_TOKENS, stream=bool(i % 2)) for i in (0, 3)]
    assert [r.text for r in again] == [reference[0], reference[3]]
    stack.wait_idle()
    pools = check_no_leak(stack.redis.url, ["worker-1/1", "worker-2/2"])
    report(
        "worker_kill9",
        {
            "requests_on_survivor": len(survivors),
            "errors_on_survivor": 0,
            "requests_lost_with_killed_worker": lost,
            **fault_figures,
            "lease_ttl_s": LEASE_TTL,
            "restart_to_healthy_s": round(restart_s, 3),
            "pools": pools,
        },
    )


def test_allocator_restart_with_memory_state_recomputes():
    """An allocator without durable state loses every pool when restarted:
    the worker re-registers (PoolLost), recomputes its running sequences,
    and every request still completes with the fault-free text."""
    prompts = PROMPTS[:4]
    reference = offline(prompts, MAX_TOKENS)
    with Stack(1, worker_args=WORKER_ARGS, env=ALLOCATOR_ENV, redis=False) as stack:
        before = worker_samples(stack)

        def fault() -> dict:
            after_some_tokens(stack, before)
            stack.kill_allocator()
            time.sleep(OUTAGE_S)
            stack.start_allocator()
            return {}

        jobs = [Job(0, p, stream=p % 2 == 1) for p in range(len(prompts))]
        results, _ = run_jobs(stack, prompts, jobs, MAX_TOKENS, during=fault)
        assert [r.status for r in results] == [200] * len(results), [r.error for r in results]
        assert [r.text for r in results] == [reference[j.prompt] for j in jobs]
        stack.wait_idle()
        figures = stall_figures(stack, before)["worker-1"]
        assert figures["step_errors"] == 0 and figures["failed_requests"] == 0
        # PoolLost: a fresh pool, everything recomputed
        assert "was dropped" in stack.workers[0].log()
        assert stack.allocator_metrics().labels(
            "pagedkv_allocator_pool_capacity_blocks", "pool_id"
        ) == {"worker-1/1"}  # a new server: epochs start over
        report(
            "allocator_restart_memory_state",
            {"requests": len(results), "errors": 0, "worker": figures},
        )
