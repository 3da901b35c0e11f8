"""Prefill/decode disaggregation through the router, with real processes.

One allocator with a `file://` shared store; a prefill worker and a decode
worker (`--kv-role`) registered with it; a router following it. A `both`
worker on its own embedded allocator gives the reference texts. Through the
router a request is computed by the prefill worker, its prompt's blocks go
through the store, and the decode worker answers with them as cached tokens:
the client sees the reference text, both workers named in headers. Then the
faults: the store failing, the prefill worker killed mid-request, the decode
worker killed after the transfer; and the fleets the router cannot split.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from tests.support.drills import scrape, wait_for
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


@pytest.fixture(scope="module")
def reference(worker_process):
    """A `both` worker of its own (embedded allocator, no store): the texts to match."""
    with worker_process("--model", MODEL, *WORKER_ARGS) as url:
        yield url


@pytest.fixture(scope="module")
def fleet(allocator_server, tmp_path_factory):
    store = tmp_path_factory.mktemp("kv-store")
    with pd_fleet(allocator_server, f"file://{store}") as f:
        yield {**f, "store": store}


@pytest.mark.parametrize(
    "n, stream, chat", [(1, False, False), (2, False, False), (1, True, False), (2, True, True)]
)
def test_a_split_request_answers_as_a_both_worker_does(fleet, reference, n, stream, chat):
    prompt = PROMPT.format(f"{n}-{stream}-{chat}")
    expected, ref_usage, _ = answer_texts(reference, prompt, n=n, chat=chat)
    before = outcome_count(fleet, "transferred")
    legs = metric(fleet["router"].url, "pagedkv_router_pd_prefill_seconds_count")
    texts, usage, headers = answer_texts(fleet["router"].url, prompt, n=n, stream=stream, chat=chat)
    assert outcome_count(fleet, "transferred") == before + 1, fleet_story(fleet)
    assert metric(fleet["router"].url, "pagedkv_router_pd_prefill_seconds_count") == legs + 1
    assert texts == expected
    assert headers["x-pagedkv-prefill-worker"] == "prefill-1"
    assert headers["x-pagedkv-worker"] == "decode-1"
    # The decode worker loaded every whole block before the prompt's last token.
    assert usage.prompt_tokens == ref_usage.prompt_tokens
    want = (usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert want > 0
    assert usage.prompt_tokens_details.cached_tokens == want, fleet_story(fleet)
    no_blocks_held(fleet["allocator"])


def test_a_split_request_counts_once_in_the_routers_request_series(fleet):
    url = fleet["router"].url

    def figures():
        return [
            metric(url, "pagedkv_router_requests_total", {"worker": w}) or 0
            for w in ("prefill-1", "decode-1")
        ] + [
            metric(url, "pagedkv_router_pd_prefill_legs_total", {"worker": "prefill-1"}) or 0,
            metric(url, "pagedkv_router_prompt_tokens_total") or 0,
            metric(url, "pagedkv_router_routing_seconds_count") or 0,
        ]

    before = figures()
    prompts = 0
    for i in range(2):
        _, usage, _ = answer_texts(url, PROMPT.format(f"counted-{i}"))
        prompts += usage.prompt_tokens
    prefill, decode, legs, prompt_tokens, routed = (
        a - b for a, b in zip(figures(), before, strict=True)
    )
    # Two client requests: two on the decode worker that answered them, none on the
    # prefill worker as client requests, two prefill legs, each prompt counted once.
    assert (prefill, decode, legs, routed) == (0, 2, 2, 2)
    assert prompt_tokens == prompts


def test_a_prefill_worker_asked_directly_answers_as_any_worker(fleet, reference):
    prompt = PROMPT.format("asked directly")
    assert answer_texts(fleet["prefill"].url, prompt)[0] == answer_texts(reference, prompt)[0]


def test_the_roles_show_in_the_listing_the_pools_page_and_metrics(fleet):
    pools = pools_by_worker(fleet["allocator"])
    assert {w: p.kv_role for w, p in pools.items()} == {
        "prefill-1": "prefill",
        "decode-1": "decode",
    }
    assert pools["prefill-1"].store_namespace == pools["decode-1"].store_namespace != ""
    for name in ("prefill", "decode"):
        info = scrape(f"{fleet[name].url}/metrics").labels(
            "pagedkv_worker_kv_cache_info", "kv_role"
        )
        assert info == {name}
    page = fleet["allocator"].metrics_url.removesuffix("/metrics")
    with httpx.stream("GET", f"{page}/pools/stream", timeout=10) as r:
        roles = set()
        for line in r.iter_lines():
            if line.startswith("data:") and '"kv_role"' in line:
                roles.add(httpx.Response(200, content=line[5:]).json()["kv_role"])
            if len(roles) == 2:
                break
    assert roles == {"prefill", "decode"}


def test_a_failing_store_leaves_the_decode_worker_to_compute_the_prompt(fleet, reference):
    prompt = PROMPT.format("the store fails")
    expected, _, _ = answer_texts(reference, prompt)
    store = fleet["store"]
    before = outcome_count(fleet, "incomplete")
    moved = store.with_name(store.name + "-away")
    store.rename(moved)
    store.write_text("not a directory: every save and load fails\n")
    try:
        texts, usage, headers = answer_texts(fleet["router"].url, prompt)
    finally:
        store.unlink()
        moved.rename(store)
    assert texts == expected
    assert headers["x-pagedkv-prefill-worker"] == "prefill-1"
    assert usage.prompt_tokens_details.cached_tokens == 0  # nothing found: all computed
    assert outcome_count(fleet, "incomplete") == before + 1
    no_blocks_held(fleet["allocator"])


def _in_flight(url: str, prompt: str):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    return pool, pool.submit(answer_texts, url, prompt)


def test_a_decode_worker_killed_after_the_transfer_fails_with_a_clear_error(fleet):
    decode = fleet["decode"]
    os.kill(decode.proc.pid, signal.SIGSTOP)  # it takes the decode leg and answers nothing
    pool, future = _in_flight(fleet["router"].url, PROMPT.format("the decode worker dies"))
    wait_for(
        lambda: (
            metric(fleet["router"].url, "pagedkv_router_in_flight_requests", {"worker": "decode-1"})
            == 1
        ),
        30,
        "the decode leg",
    )
    decode.kill()
    with pytest.raises(openai.APIStatusError) as err:
        future.result(timeout=60)
    pool.shutdown()
    assert err.value.status_code == 503
    assert err.value.body["code"] == "no_worker_available"
    # the prefill pool holds nothing; the dead pool goes at its lease's end
    wait_for(
        lambda: "decode-1" not in pools_by_worker(fleet["allocator"]), 30, "the dead pool to go"
    )
    no_blocks_held(fleet["allocator"])
    decode.start().wait_healthy(120)  # back for the next test
    wait_for(
        lambda: httpx.get(f"{fleet['router'].url}/health").json()["workers"] == 2,
        30,
        "the router to know the decode worker again",
    )


def test_a_prefill_worker_killed_mid_request_leaves_the_decode_worker_to_compute(fleet, reference):
    prompt = PROMPT.format("the prefill worker dies")
    expected, _, _ = answer_texts(reference, prompt)
    prefill = fleet["prefill"]
    os.kill(prefill.proc.pid, signal.SIGSTOP)  # it takes the request and answers nothing
    pool, future = _in_flight(fleet["router"].url, prompt)
    wait_for(
        lambda: (
            metric(
                fleet["router"].url, "pagedkv_router_in_flight_requests", {"worker": "prefill-1"}
            )
            == 1
        ),
        30,
        "the prefill leg",
    )
    prefill.kill()
    texts, usage, headers = future.result(timeout=60)
    pool.shutdown()
    assert texts == expected
    assert headers["x-pagedkv-prefill-worker"] == ""  # no prefill worker answered
    assert headers["x-pagedkv-worker"] == "decode-1"
    assert outcome_count(fleet, "prefill_failed") == 1
    # its pool dropped at its lease's end; the decode pool holds nothing
    wait_for(
        lambda: "prefill-1" not in pools_by_worker(fleet["allocator"]), 30, "the dead pool to go"
    )
    no_blocks_held(fleet["allocator"])
    # a decode-only fleet now: the router says why it cannot answer
    wait_for(
        lambda: httpx.get(f"{fleet['router'].url}/health").json()["workers"] == 1,
        30,
        "the router to drop the prefill worker",
    )
    with pytest.raises(openai.APIStatusError) as err:
        answer_texts(fleet["router"].url, prompt)
    assert err.value.status_code == 503
    assert err.value.body["code"] == "no_worker_for_role"
    assert "only decode workers" in err.value.body["message"]


def _worker_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker", "--model", MODEL, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_bad_role_is_one_line_and_exit_2():
    r = _worker_cli("--kv-role", "bogus")
    assert r.returncode == 2
    assert "--kv-role: invalid choice: 'bogus'" in r.stderr
    assert len(r.stderr.strip().splitlines()[-1]) < 300


def test_a_role_without_the_shared_store_is_one_line_and_exit_2():
    r = _worker_cli(
        "--allocator", "127.0.0.1:9", "--kv-role", "prefill", "--no-kv-shared-store", "--port", "0"
    )
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line == (
        "pagedkv worker: error: --kv-role prefill needs the allocator's shared store and prefix "
        "caching (the prompt's blocks move through the store): drop --no-kv-shared-store and "
        "--no-enable-prefix-caching"
    )


def test_a_role_on_the_embedded_allocator_is_one_line_and_exit_2():
    r = _worker_cli("--kv-role", "decode", "--port", "0")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line == (
        "pagedkv worker: error: --kv-role decode needs an allocator service with a shared store "
        "(--allocator HOST:PORT of an allocator run with --kv-shared-store): the embedded one "
        "has none"
    )


def test_a_role_at_an_allocator_without_a_store_is_refused(allocator_server):
    with allocator_server() as alloc:
        r = _worker_cli("--allocator", alloc.address, "--kv-role", "decode", "--port", "0")
    assert r.returncode == 2
    assert "a decode pool needs the shared store" in r.stderr.strip().splitlines()[-1]
