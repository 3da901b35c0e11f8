"""Load drill: many concurrent HTTP clients (completions and chat, streaming
and not) against two workers, and many concurrent pools against the same
allocator (Redis journal), for a bounded time.

Asserted: no request fails, every greedy text equals the offline engine's,
every pool's answers equal the in-process core's, and no process grows once
warm (a generous bound: this is a leak detector, not a benchmark). The
figures (requests served, errors, p50/p99 latency, RSS of each process) are
printed as one `DRILL {...}` JSON line:

    python -m pytest tests/drills/test_load.py -s
    PAGEDKV_DRILL_SECONDS=120 python -m pytest tests/drills/test_load.py -s   # a longer run
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time

import httpx
import pytest

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import PoolConfig
from tests.support.allocator import random_steps
from tests.support.drills import (
    POOLS_TOKEN,
    Stack,
    check_no_leak,
    complete,
    error_requests,
    percentile,
    reference_texts,
    report,
    scrape,
)

SECONDS = float(os.environ.get("PAGEDKV_DRILL_SECONDS", "20"))  # the measured phase
WARMUP_S = 6.0  # before the first memory reading
HTTP_CLIENTS = 8
POOL_CLIENTS = 12
STEPS_PER_POOL = 40  # then the pool is deregistered and a new one registered
PROMPTS = [
    f"q{i}: " + w
    for i, w in enumerate(["hello", "paged kv", "blocks", "a b c d e f", "tables", "fox"])
]
MAX_TOKENS = 8
WORKER_ARGS = [
    "--num-blocks",
    "24",
    "--block-size",
    "4",
    "--enable-prefix-caching",
    "--max-model-len",
    "64",
]
MIB = 1 << 20
# Growth allowed once warm. Generous on purpose (allocator pages, glibc
# arenas, torch's caching); a leak per request or per pool exceeds it fast.
RSS_BOUND = {"worker": 64 * MIB, "allocator": 48 * MIB, "redis": 32 * MIB}


@pytest.fixture(scope="module")
def references():
    return {
        False: reference_texts(PROMPTS, MAX_TOKENS),
        True: reference_texts(PROMPTS, MAX_TOKENS, chat=True),
    }


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.mismatches = 0
        self.count = 0
        self.streamed = 0
        self.pools = 0

    def add(
        self, latency: float, error: str = "", mismatch: bool = False, streamed: bool = False
    ) -> None:
        with self.lock:
            self.count += 1
            self.latencies.append(latency)
            self.streamed += streamed
            self.mismatches += mismatch
            if error:
                self.errors.append(error)

    def figures(self, unit: float = 1.0) -> dict:
        return {
            "requests": self.count,
            "errors": len(self.errors),
            "p50": round(percentile(self.latencies, 50) * unit, 3),
            "p99": round(percentile(self.latencies, 99) * unit, 3),
        }


def http_client(stack: Stack, i: int, stop: threading.Event, tally: Tally, references) -> None:
    rng = random.Random(i)
    kinds = itertools.cycle(
        [(False, False), (True, False), (False, True), (True, True)][i % 4 :] * 2
    )
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            stream, chat = next(kinds)
            p = rng.randrange(len(PROMPTS))
            url = stack.workers[rng.randrange(len(stack.workers))].url
            r = complete(url, PROMPTS[p], MAX_TOKENS, stream=stream, chat=chat, client=client)
            tally.add(
                r.latency_s,
                r.error if r.status != 200 else "",
                mismatch=r.status == 200 and r.text != references[chat][p],
                streamed=stream,
            )


def pool_client(address: str, i: int, stop: threading.Event, tally: Tally) -> None:
    """Register, run a random workload checked against the in-process core,
    deregister; again until stopped."""
    for round_ in itertools.count():
        if stop.is_set():
            return
        spec = PoolSpec(f"load-{i}", PoolConfig(64, 4, True, "load-model"))
        try:
            remote = GrpcAllocator(address, spec, auth_token=POOLS_TOKEN, heartbeat=False)
        except Exception as exc:  # noqa: BLE001 - counted, the drill goes on
            tally.add(0.0, repr(exc))
            continue
        with tally.lock:
            tally.pools += 1
        core = EmbeddedAllocator(spec)
        for ops in random_steps(seed=i * 1000 + round_, steps=STEPS_PER_POOL):
            if stop.is_set():
                break
            t0 = time.perf_counter()
            try:
                got = remote.step(ops)
            except Exception as exc:  # noqa: BLE001
                tally.add(time.perf_counter() - t0, repr(exc))
                continue
            tally.add(time.perf_counter() - t0, mismatch=got != core.step(ops))
        try:
            assert remote.integrity_problems() == []
        except Exception as exc:  # noqa: BLE001
            tally.add(0.0, f"integrity: {exc!r}")
        remote.close()


def run_phase(
    stack: Stack, seconds: float, http: Tally, pools: Tally, references
) -> list[dict[str, int]]:
    """Run the load for `seconds`; the RSS of every process every 5 s."""
    stop = threading.Event()
    threads = [
        threading.Thread(target=http_client, args=(stack, i, stop, http, references), daemon=True)
        for i in range(HTTP_CLIENTS)
    ]
    threads += [
        threading.Thread(
            target=pool_client, args=(stack.allocator_address, i, stop, pools), daemon=True
        )
        for i in range(POOL_CLIENTS)
    ]
    for t in threads:
        t.start()
    timeline = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(5.0, left))
        timeline.append(stack.rss())
    stop.set()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads)
    return timeline


def test_load_no_errors_and_flat_memory(references):
    with Stack(2, worker_args=WORKER_ARGS, redis=True) as stack:
        # warm: caches, arenas, connections
        run_phase(stack, WARMUP_S, Tally(), Tally(), references)
        warm = stack.rss()
        http, pools = Tally(), Tally()
        t0 = time.monotonic()
        timeline = run_phase(stack, SECONDS, http, pools, references)
        elapsed = time.monotonic() - t0
        end = stack.rss()
        stack.wait_idle()
        samples = [scrape(f"{w.url}/metrics") for w in stack.workers]
        events = stack.allocator_metrics().value("pagedkv_allocator_event_sequence")
        check_no_leak(stack.redis.url, ["worker-1/1", "worker-2/1"])  # load pools all deregistered

        growth = {name: end[name] - warm[name] for name in warm}
        figures = {
            "seconds": round(elapsed, 1),
            "http": {
                **http.figures(),
                "streamed": http.streamed,
                "mismatches": http.mismatches,
                "unit": "s",
                "clients": HTTP_CLIENTS,
            },
            "allocator_steps": {
                **pools.figures(1000),
                "mismatches": pools.mismatches,
                "unit": "ms",
                "pools_registered": pools.pools,
                "concurrent_pools": POOL_CLIENTS,
            },
            "preemptions": sum(s.value("pagedkv_worker_preemptions_total") for s in samples),
            "rss_mib": {
                name: {
                    "warm": round(warm[name] / MIB, 1),
                    "end": round(end[name] / MIB, 1),
                    "growth": round(growth[name] / MIB, 1),
                }
                for name in warm
            },
            # the allocator keeps the last 65,536 KV events for WatchEvents: it grows until then
            "allocator_kv_events": int(events),
            "allocator_rss_every_5s_mib": [round(r["allocator"] / MIB, 1) for r in timeline],
            "first_errors": (http.errors + pools.errors)[:3],
        }
        report("load", figures)
        assert http.count > 0 and pools.count > 0
        assert http.errors == [] and pools.errors == []
        assert http.mismatches == 0 and pools.mismatches == 0
        assert all(
            s.value("pagedkv_worker_step_errors_total") == 0 and error_requests(s) == 0
            for s in samples
        )
        for name, g in growth.items():
            bound = RSS_BOUND["worker" if name.startswith("worker") else name]
            assert g <= bound, (
                f"{name} grew {g / MIB:.1f} MiB once warm (bound {bound / MIB:.0f} MiB)"
            )
