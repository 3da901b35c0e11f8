"""`docker compose up`, for real, continued (issue 16): the stack that
tests/compose/test_compose.py brought up and chatted with (the same one: the engine and
the stack are session fixtures of tests/compose/conftest.py), now under load, then
taken down. This file runs after test_compose.py (name order), so `down` comes last.

    python -m pytest -m compose -s        (as root; .ci/run runs it after `make test`)

4. A workload on both workers with pools small enough to preempt, run twice:
   once undisturbed, once with `docker-compose restart allocator` in the
   middle. Every request completes, with the same text, and the allocator
   comes back with the same pools from its Redis journal (nothing recomputed).
5. Prometheus scrapes utilisation and preemption series from every target.
6. `docker-compose down -v` leaves no container, network or volume behind.

Each step prints a `COMPOSE {...}` line with its timings.
"""

from __future__ import annotations

import concurrent.futures
import re
import time

import pytest

from tests.support.compose import (
    MAX_TOKENS,
    PROMPTS,
    WORKERS,
    Stack,
    chat,
    note,
    prom_query,
    scrape,
    total,
)
from tests.support.drills import wait_for

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2400)]


# ------------------------------------------------------------------ the workload


def run_workload(stack: Stack, during=None) -> tuple[list[dict], object]:
    """Every prompt on both workers at once (odd ones streamed); `during()`
    runs beside them. The results in (worker, prompt) order, and what
    `during` returned."""
    jobs = [(w, p) for w in WORKERS for p in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs) + 1) as pool:
        futures = [
            pool.submit(
                chat,
                stack.url(w),
                PROMPTS[p],
                key=stack.api_key,
                max_tokens=MAX_TOKENS,
                stream=p % 2 == 1,
                ignore_eos=True,
            )
            for w, p in jobs
        ]
        extra = pool.submit(during) if during else None
        results = [f.result() for f in futures]
        return results, (extra.result() if extra else None)


def generated(stack: Stack) -> float:
    return sum(
        total(scrape(stack.url(w)), "pagedkv_worker_generation_tokens_total") for w in WORKERS
    )


@pytest.fixture(scope="module")
def workload(stack):
    """The workload undisturbed, then again with the allocator restarted in
    the middle; the figures of both."""
    before = {w: scrape(stack.url(w)) for w in WORKERS}
    t0 = time.monotonic()
    reference, _ = run_workload(stack)
    reference_s = time.monotonic() - t0
    mid = {w: scrape(stack.url(w)) for w in WORKERS}

    def restart() -> dict:
        # (counted from before the workload was sent, not from now: it is under way already)
        start = sum(total(mid[w], "pagedkv_worker_generation_tokens_total") for w in WORKERS)
        wait_for(
            lambda: generated(stack) >= start + 16,
            120,
            "the workload to be under way",
            interval_s=0.2,
        )
        t = time.monotonic()
        stack.compose("restart", "allocator", timeout=180)
        restart_s = time.monotonic() - t
        wait_for(
            lambda: stack.health("allocator") == "running/healthy",
            120,
            "the allocator to be healthy again",
            interval_s=1,
        )
        return {
            "restart_s": round(restart_s, 2),
            "restart_to_healthy_s": round(time.monotonic() - t, 2),
        }

    t0 = time.monotonic()
    results, fault = run_workload(stack, during=restart)
    fault_run_s = time.monotonic() - t0
    after = {w: scrape(stack.url(w)) for w in WORKERS}

    def delta(name: str, a: dict, b: dict) -> dict:
        return {w: total(a[w], name) - total(b[w], name) for w in WORKERS}

    figures = {
        "requests": len(results),
        "reference_s": round(reference_s, 1),
        "fault_run_s": round(fault_run_s, 1),
        **fault,
        "preemptions_reference": delta("pagedkv_worker_preemptions_total", mid, before),
        "preemptions_fault_run": delta("pagedkv_worker_preemptions_total", after, mid),
        "allocator_retries": delta("pagedkv_worker_allocator_retries_total", after, mid),
        "stall_s": {
            w: round(v, 2)
            for w, v in delta(
                "pagedkv_worker_allocator_unavailable_seconds_total", after, mid
            ).items()
        },
        "step_errors": delta("pagedkv_worker_step_errors_total", after, mid),
        "max_latency_s": round(max(r["latency_s"] for r in results), 2),
    }
    note("workload", **figures)
    if any(r["status"] != 200 for r in (*reference, *results)):
        for svc in ("allocator", *WORKERS):
            print(f"--- {svc} (last lines)\n{stack.logs(svc)[-6000:]}", flush=True)
    return {"reference": reference, "results": results, "figures": figures}


def test_allocator_restart_mid_workload_completes_every_request_from_the_journal(stack, workload):
    reference, results, figures = workload["reference"], workload["results"], workload["figures"]
    for r in (*reference, *results):
        assert r["status"] == 200, r
        assert r["finish"] == "length", r
    # the same text as without the restart (greedy; recomputing would give it too,
    # but nothing was recomputed: see below)
    assert [r["text"] for r in results] == [r["text"] for r in reference]
    # The pools were small enough to preempt, so the blocks really were contended.
    assert all(n > 0 for n in figures["preemptions_reference"].values()), figures
    assert figures["step_errors"] == {w: 0 for w in WORKERS}, figures

    # The allocator came back from its Redis journal with both pools ...
    log = stack.logs("allocator")
    listening = re.findall(r"pagedkv allocator: listening on .*?(\d+) pools restored\)", log)
    assert len(listening) == 2 and listening[-1] == "2", log[-3000:]
    assert re.search(r"restored 2 pools from redis://redis:6379/0", log), log[-3000:]
    # ... the same ones: no worker lost its pool and recomputed.
    for w in WORKERS:
        assert "was dropped" not in stack.logs(w)
    pools = {
        r["metric"]["pool_id"] for r in prom_query(stack, "pagedkv_allocator_pool_capacity_blocks")
    }
    assert pools == {"worker-1/1", "worker-2/1"}


def test_prometheus_scrapes_utilisation_and_preemption_series_from_every_target(stack, workload):
    allocator, router, workers = "allocator:9400", "router:8000", {f"{w}:8000" for w in WORKERS}

    def series(expr: str) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for r in prom_query(stack, expr):
            out.setdefault(r["metric"]["instance"], []).append(r)
        return out

    seen: dict[str, object] = {}

    def scraped() -> bool:
        seen["up"] = {i: float(rs[0]["value"][1]) for i, rs in series("up").items()}
        seen["preemptions"] = sorted(series("pagedkv_worker_preemptions_total > 0"))
        up = {allocator: 1.0, router: 1.0, **dict.fromkeys(workers, 1.0)}
        return seen["up"] == up and set(seen["preemptions"]) == workers

    t0 = time.monotonic()
    try:
        wait_for(
            scraped,
            60,
            "Prometheus to scrape every target and the workload's preemptions",
            interval_s=1,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen}") from None
    # utilisation: the allocator's per pool, each worker's of its own pool
    util = series("pagedkv_allocator_pool_slot_utilisation_ratio")
    assert set(util) == {allocator}
    assert {r["metric"]["worker_id"] for r in util[allocator]} == set(WORKERS)
    assert set(series("pagedkv_worker_kv_slot_utilisation_ratio")) == workers
    # preemption: each worker counts its own, by cause (above: > 0 on both). The
    # allocator never preempts (the worker plans against its exact count of free
    # blocks and gives blocks back first); its side is the "out of blocks"
    # answers, a series for each pool.
    oob = series("pagedkv_allocator_out_of_blocks_total")
    assert set(oob) == {allocator} and {r["metric"]["worker_id"] for r in oob[allocator]} == set(
        WORKERS
    )
    # the router: the chat test's request through it is counted, by the worker it chose
    routed = series("pagedkv_router_requests_total")
    assert set(routed) == {router} and {r["metric"]["worker"] for r in routed[router]} <= set(
        WORKERS
    )
    note(
        "prometheus",
        targets=sorted([allocator, router, *workers]),
        wait_s=round(time.monotonic() - t0, 1),
    )


def test_down_leaves_no_container_network_or_volume(stack):
    assert any(stack.left_behind().values())  # the labels this test checks are there while it runs
    t0 = time.monotonic()
    stack.compose("down", "-v", "--remove-orphans", timeout=300)
    stack.down = True
    assert stack.left_behind() == {"containers": [], "networks": [], "volumes": []}
    if stack.private_engine:
        # nothing else either: no build container of deploy/local-images.sh, no stray volume
        assert stack.docker("ps", "-aq").stdout.split() == []
        assert stack.docker("volume", "ls", "-q").stdout.split() == []
    note("down", seconds=round(time.monotonic() - t0, 1))
