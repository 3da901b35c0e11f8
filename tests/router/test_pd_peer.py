"""Prefill/decode disaggregation over the direct path (`--kv-shared-store
peer://`), with real processes: no store anywhere; the decode worker pulls the
prompt's blocks from the prefill worker's memory over its peer route.

Through the router a request answers as a `both` worker does, the decode side
counts the transferred blocks as cached tokens, and the blocks it loaded are
the blocks the prefill worker served. The peer route answers no one without
the store group's key. A prefill worker killed after its entries are indexed
leaves the decode worker to compute them (the same answer, nothing leaked),
and its entries leave the index with its pool. A worker that advertises no
URL cannot use the peer store.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.client.router_client import RouterClient
from allocator_service.core import PoolConfig
from tests.support.drills import wait_for
from tests.support.http import metric
from tests.support.pd import (
    BLOCK,
    MODEL,
    PROMPT,
    WORKER_ARGS,
    answer_texts,
    fleet_story,
    no_blocks_held,
    outcome_count,
    pd_fleet,
    pools_by_worker,
)
from worker.tiers.store import PEER_ROUTE


def _tier(url: str, name: str) -> float:
    return metric(url, f"pagedkv_worker_kv_tier_{name}_total", {"tier": "shared"}) or 0.0


@pytest.fixture(scope="module")
def reference(worker_process):
    """A `both` worker of its own (embedded allocator, no store): the texts to match."""
    with worker_process("--model", MODEL, *WORKER_ARGS) as url:
        yield url


@pytest.fixture(scope="module")
def fleet(allocator_server):
    with pd_fleet(allocator_server, "peer://") as f:
        yield f


@pytest.mark.parametrize(
    "n, stream, chat", [(1, False, False), (2, False, False), (1, True, False), (2, True, True)]
)
def test_a_split_request_over_the_direct_path_answers_as_a_both_worker(
    fleet, reference, n, stream, chat
):
    prompt = PROMPT.format(f"{n}-{stream}-{chat} over the direct path")
    expected, ref_usage, _ = answer_texts(reference, prompt, n=n, chat=chat)
    prefill, decode = fleet["prefill"].url, fleet["decode"].url
    served, loaded = _tier(prefill, "served_blocks"), _tier(decode, "loaded_blocks")
    before = outcome_count(fleet, "transferred")
    texts, usage, headers = answer_texts(fleet["router"].url, prompt, n=n, stream=stream, chat=chat)
    assert texts == expected
    assert outcome_count(fleet, "transferred") == before + 1, fleet_story(fleet)
    assert headers["x-pagedkv-prefill-worker"] == "prefill-1"
    assert headers["x-pagedkv-worker"] == "decode-1"
    assert usage.prompt_tokens == ref_usage.prompt_tokens
    want = (usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert want > 0
    assert usage.prompt_tokens_details.cached_tokens == want, fleet_story(fleet)
    # every block the decode worker loaded, the prefill worker served it
    assert _tier(decode, "loaded_blocks") - loaded == want // BLOCK
    assert _tier(prefill, "served_blocks") - served == want // BLOCK
    # what the prefill worker holds of the store is in its memory, within the store's size
    held = metric(prefill, "pagedkv_worker_kv_tier_used_bytes", {"tier": "shared"})
    assert 0 < held <= metric(prefill, "pagedkv_worker_kv_tier_capacity_bytes", {"tier": "shared"})
    no_blocks_held(fleet["allocator"])


def test_the_peer_route_answers_only_the_store_groups_key(fleet):
    url = fleet["prefill"].url + PEER_ROUTE
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        r = httpx.post(url, content=b"somekey", headers=headers, timeout=10)
        assert r.status_code == 401
    assert httpx.get(url, timeout=10).status_code == 405
    # a pool of the store group gets the key at registration, and the route answers it
    spec = PoolSpec(
        "probe",
        PoolConfig(
            num_blocks=8,
            block_size=BLOCK,
            enable_prefix_caching=True,
            model_fingerprint="probe",
            layout="probe",
            block_bytes=64,
            use_shared_store=True,
        ),
        advertise_url="http://127.0.0.1:9",
    )
    probe = GrpcAllocator(fleet["allocator"].address, spec, heartbeat=False)
    try:
        key = {"Authorization": f"Bearer {probe.peer_key}"}
        r = httpx.post(url, content=b"never-saved", headers=key, timeout=10)
        assert r.status_code == 200 and r.content == bytes(8)  # one frame: absent
        assert httpx.post(url, content=b"../x", headers=key, timeout=10).status_code == 400
    finally:
        probe.close()


def test_a_killed_prefill_worker_leaves_the_decode_worker_to_compute(fleet, reference):
    """Last in the module: the prefill worker stays dead."""
    prompt = PROMPT.format("the prefill worker dies after its leg, peer")
    expected, _, _ = answer_texts(reference, prompt)
    prefill, decode, alloc = fleet["prefill"], fleet["decode"], fleet["allocator"]
    # the prefill worker computes the prompt; its blocks are indexed as its entries
    assert answer_texts(prefill.url, prompt)[0] == expected
    tokens = httpx.post(
        f"{prefill.url}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=10
    ).json()["tokens"]
    want = (len(tokens) - 1) // BLOCK * BLOCK
    pools = pools_by_worker(alloc)
    router_client = RouterClient(alloc.address)

    def decode_finds_them() -> bool:
        matches = router_client.match_prefix(pools["decode-1"].model_fingerprint, tokens)
        return any(m.worker_id == "decode-1" and m.store_tokens == want for m in matches)

    wait_for(decode_finds_them, 30, "the prefill worker's entries to be present")
    errors = _tier(decode.url, "store_errors")
    prefill.kill()  # SIGKILL, reaped
    # asked while the dead worker's entries are still indexed: the pull fails, it computes
    texts, usage, _ = answer_texts(decode.url, prompt)
    assert texts == expected
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert _tier(decode.url, "store_errors") == errors + 1
    assert (
        metric(decode.url, "pagedkv_worker_kv_tier_refused_entries_total", {"tier": "shared"})
        is None
    )  # a writer that does not answer is a miss, not a refusal
    # the dead pool goes at its lease's end, and every entry it wrote with it: those left
    # are the decode worker's own (the blocks its answers filled)
    wait_for(lambda: "prefill-1" not in pools_by_worker(alloc), 30, "the dead pool to go")
    page = alloc.metrics_url.removesuffix("/metrics")
    assert metric(page, "pagedkv_allocator_shared_store_entries") == _tier(
        decode.url, "saved_blocks"
    )
    no_blocks_held(alloc)
    # the decode worker still answers it, from its own KV pool now
    texts, usage, _ = answer_texts(decode.url, prompt)
    assert texts == expected and usage.prompt_tokens_details.cached_tokens == want
    router_client.close()


def test_a_worker_without_an_advertised_url_is_refused_in_one_line(allocator_server):
    with allocator_server("--kv-shared-store", "peer://", "--kv-shared-store-size", "0.01") as a:
        r = subprocess.run(
            [sys.executable, "-m", "worker", "--model", MODEL, "--allocator", a.address]
            + ["--port", "0", "--block-size", str(BLOCK)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2, r.stderr
    assert "must advertise its worker's URL (--advertise-url)" in r.stderr.strip().splitlines()[-1]
