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

from allocator_service.client.router_client import RouterClient
from pagedkv.stack import RouterProcess, WorkerProcess
from tests.support.drills import scrape, wait_for
from tests.support.http import metric

MODEL = "tiny-random"
BLOCK = 4
WORKER_ARGS = ["--num-blocks", "96", "--block-size", str(BLOCK), "--max-model-len", "256"]
PROMPT = "{}: the prefill worker computes this prompt, and the decode worker loads it"


def _worker(name: str, allocator: str, *args: str) -> WorkerProcess:
    return WorkerProcess(
        name,
        model=MODEL,
        allocator=allocator,
        args=["--log-level", "warning", "--threads", "1", *WORKER_ARGS, *args],
    )


def _router(allocator: str) -> RouterProcess:
    return RouterProcess(
        model=MODEL,
        allocator=allocator,
        args=["--log-level", "warning"],
        # long enough for a busy machine to confirm the blocks (a transfer cut short is
        # computed, which the cached-token checks would read as a failure), short enough
        # for the failing-store case, which waits it out
        env={"PAGEDKV_ROUTER_PD_TRANSFER_TIMEOUT": "15"},
    )


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _texts(url: str, prompt: str, *, n: int = 1, stream: bool = False, chat: bool = False):
    """(texts by choice index, usage, headers) of one greedy request through `url`."""
    kw = dict(model=MODEL, max_tokens=8, temperature=0, n=n, stream=stream)
    if stream:
        kw["stream_options"] = {"include_usage": True}
    c = _client(url)
    if chat:
        raw = c.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": prompt}], **kw
        )
    else:
        raw = c.completions.with_raw_response.create(prompt=prompt, **kw)
    answer = raw.parse()
    texts = [""] * n
    usage = None
    for part in answer if stream else [answer]:
        usage = part.usage or usage
        for ch in part.choices:
            piece = (ch.delta.content if stream else ch.message.content) if chat else ch.text
            texts[ch.index] += piece or ""
    return texts, usage, raw.headers


@pytest.fixture(scope="module")
def reference(worker_process):
    """A `both` worker of its own (embedded allocator, no store): the texts to match."""
    with worker_process("--model", MODEL, *WORKER_ARGS) as url:
        yield url


@pytest.fixture(scope="module")
def fleet(allocator_server, tmp_path_factory):
    store = tmp_path_factory.mktemp("kv-store")
    with allocator_server(
        "--kv-shared-store",
        f"file://{store}",
        "--kv-shared-store-size",
        "0.05",
        "--metrics-port",
        "0",
        env={"PAGEDKV_ALLOCATOR_LEASE_TTL": "5"},
    ) as alloc:
        prefill = _worker("prefill-1", alloc.address, "--kv-role", "prefill").start()
        decode = _worker("decode-1", alloc.address, "--kv-role", "decode").start()
        router = None
        try:
            prefill.wait_healthy(120)
            decode.wait_healthy(120)
            router = _router(alloc.address).start()
            router.wait_healthy(60)
            wait_for(
                lambda: httpx.get(f"{router.url}/health").json()["workers"] == 2,
                30,
                "the router to know both workers",
            )
            yield {
                "allocator": alloc,
                "prefill": prefill,
                "decode": decode,
                "router": router,
                "store": store,
            }
        finally:
            for p in (router, prefill, decode):
                if p is not None:
                    p.terminate()


def _pools(alloc) -> dict[str, object]:
    return {p.worker_id: p for p in RouterClient(alloc.address).list_pools()}


def _outcome(fleet, outcome: str) -> float:
    url = fleet["router"].url
    return metric(url, "pagedkv_router_pd_requests_total", {"outcome": outcome})


def _no_blocks_held(alloc) -> None:
    wait_for(
        lambda: all(p.used_blocks == 0 for p in _pools(alloc).values()),
        30,
        "every pool to hold no block",
    )


@pytest.mark.parametrize(
    "n, stream, chat", [(1, False, False), (2, False, False), (1, True, False), (2, True, True)]
)
def test_a_split_request_answers_as_a_both_worker_does(fleet, reference, n, stream, chat):
    prompt = PROMPT.format(f"{n}-{stream}-{chat}")
    expected, ref_usage, _ = _texts(reference, prompt, n=n, chat=chat)
    before = _outcome(fleet, "transferred")
    legs = metric(fleet["router"].url, "pagedkv_router_pd_prefill_seconds_count")
    texts, usage, headers = _texts(fleet["router"].url, prompt, n=n, stream=stream, chat=chat)
    assert _outcome(fleet, "transferred") == before + 1
    assert metric(fleet["router"].url, "pagedkv_router_pd_prefill_seconds_count") == legs + 1
    assert texts == expected
    assert headers["x-pagedkv-prefill-worker"] == "prefill-1"
    assert headers["x-pagedkv-worker"] == "decode-1"
    # The decode worker loaded every whole block before the prompt's last token.
    assert usage.prompt_tokens == ref_usage.prompt_tokens
    want = (usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert want > 0
    assert usage.prompt_tokens_details.cached_tokens == want
    _no_blocks_held(fleet["allocator"])


def test_a_prefill_worker_asked_directly_answers_as_any_worker(fleet, reference):
    prompt = PROMPT.format("asked directly")
    assert _texts(fleet["prefill"].url, prompt)[0] == _texts(reference, prompt)[0]


def test_the_roles_show_in_the_listing_the_pools_page_and_metrics(fleet):
    pools = _pools(fleet["allocator"])
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
    expected, _, _ = _texts(reference, prompt)
    store = fleet["store"]
    before = _outcome(fleet, "incomplete")
    moved = store.with_name(store.name + "-away")
    store.rename(moved)
    store.write_text("not a directory: every save and load fails\n")
    try:
        texts, usage, headers = _texts(fleet["router"].url, prompt)
    finally:
        store.unlink()
        moved.rename(store)
    assert texts == expected
    assert headers["x-pagedkv-prefill-worker"] == "prefill-1"
    assert usage.prompt_tokens_details.cached_tokens == 0  # nothing found: all computed
    assert _outcome(fleet, "incomplete") == before + 1
    _no_blocks_held(fleet["allocator"])


def _in_flight(url: str, prompt: str):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    return pool, pool.submit(_texts, url, prompt)


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
    wait_for(lambda: "decode-1" not in _pools(fleet["allocator"]), 30, "the dead pool to go")
    _no_blocks_held(fleet["allocator"])
    decode.start().wait_healthy(120)  # back for the next test
    wait_for(
        lambda: httpx.get(f"{fleet['router'].url}/health").json()["workers"] == 2,
        30,
        "the router to know the decode worker again",
    )


def test_a_prefill_worker_killed_mid_request_leaves_the_decode_worker_to_compute(fleet, reference):
    prompt = PROMPT.format("the prefill worker dies")
    expected, _, _ = _texts(reference, prompt)
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
    assert _outcome(fleet, "prefill_failed") == 1
    # its pool dropped at its lease's end; the decode pool holds nothing
    wait_for(lambda: "prefill-1" not in _pools(fleet["allocator"]), 30, "the dead pool to go")
    _no_blocks_held(fleet["allocator"])
    # a decode-only fleet now: the router says why it cannot answer
    wait_for(
        lambda: httpx.get(f"{fleet['router'].url}/health").json()["workers"] == 1,
        30,
        "the router to drop the prefill worker",
    )
    with pytest.raises(openai.APIStatusError) as err:
        _texts(fleet["router"].url, prompt)
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
