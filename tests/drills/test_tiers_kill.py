"""kill -9 of a worker in the middle of its saves to the shared store.

Two tiny-random workers with a host tier each share a `file://` store through
one allocator (its state in a private Redis). Worker 1 serves one prompt, then
a burst of others, whose blocks are written through to the store as they are
freed, and is killed (SIGKILL) while the burst is in flight, with saves
written and not yet confirmed. Its pool's lease runs out and the allocator drops it with its
pending saves. Then worker 2 serves the same prompts: every text is the one a
worker with no store gives, it refuses no entry (none it loads is half
written or another's), and every entry the allocator's index counts has its
file in the store.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import pytest

from tests.support.drills import Stack, wait_for
from tests.support.http import metric

pytestmark = pytest.mark.slow

WORKER_ARGS = [
    "--num-blocks",
    "64",
    "--block-size",
    "4",
    "--enable-prefix-caching",
    "--max-model-len",
    "256",
    "--kv-offloading-size",
    "0.0001",
]
BURST_TOKENS = 64
PROMPTS = [" ".join(f"conversation {c} line {i} says hello" for i in range(3)) for c in range(12)]


def complete(url: str, prompt: str, salt: str | None = None, max_tokens: int = 8) -> str | None:
    body = {
        "model": "tiny-random",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    except httpx.HTTPError:
        return None  # the worker killed under it
    return r.json()["choices"][0]["text"] if r.status_code == 200 else None


def test_a_worker_killed_mid_saves_leaves_no_entry_that_is_not_whole(tmp_path):
    store = tmp_path / "kv"
    args = ["--kv-shared-store", f"file://{store}", "--kv-shared-store-size", "0.01"]
    with Stack(
        2, worker_args=WORKER_ARGS, allocator_args=args, env={"PAGEDKV_ALLOCATOR_LEASE_TTL": "3"}
    ) as stack:
        one, two = (w.url for w in stack.workers)
        # The texts with no store to share: each under a salt of its own on worker 2.
        reference = [complete(two, p, salt=f"reference-{i}") for i, p in enumerate(PROMPTS)]
        assert None not in reference

        def saved() -> float:
            return metric(one, "pagedkv_worker_kv_tier_saved_blocks_total", {"tier": "shared"}) or 0

        # The first prompt alone, its saves confirmed (worker 1 idle: its calls stop), then
        # the others at once, killed at their first save written.
        assert complete(one, PROMPTS[0]) == reference[0]
        calls = [-1.0]

        def quiet() -> bool:
            n = metric(one, "pagedkv_worker_allocator_calls_total")
            settled, calls[0] = n == calls[0], n
            return settled

        wait_for(quiet, 60, "worker 1's last report", interval_s=0.5)
        before = saved()
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            # long answers: the burst is still in flight at the first save, even on a busy machine
            futures = [pool.submit(complete, one, p, None, BURST_TOKENS) for p in PROMPTS[1:]]
            wait_for(lambda: saved() > before, 60, "worker 1's next store saves", interval_s=0.01)
            stack.workers[0].kill()
            answered = sum(f.result() is not None for f in futures)
        assert answered < len(PROMPTS) - 1  # killed mid-burst

        def dropped() -> bool:
            return stack.allocator_metrics().value("pagedkv_allocator_pools") == 1

        wait_for(dropped, 60, "the killed worker's pool to be dropped")
        texts = [complete(two, p) for p in PROMPTS]
        assert texts == reference
        assert (
            metric(two, "pagedkv_worker_kv_tier_refused_entries_total", {"tier": "shared"}) or 0
        ) == 0
        assert (metric(two, "pagedkv_worker_kv_tier_hit_tokens_total", {"tier": "shared"}) or 0) > 0
        entries = stack.allocator_metrics().value("pagedkv_allocator_shared_store_entries")
        files = [p for p in Path(store).rglob("*") if p.is_file() and not p.name.startswith(".")]
        assert 0 < entries <= len(files)
