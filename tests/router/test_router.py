"""The router in front of real workers (LocalStack: an allocator with
tokens, two tiny-random workers, the router with its own router token),
driven by the official openai client:
the same greedy text as a worker gives directly, requests placed where their
prefix lives (by the router's copy of the pools' caches, kept from the
allocator's events, as by asking MatchPrefix), salts that do not attract each
other, a worker that joins used without a restart, a killed worker routed
around without a failed request."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from allocator_service.client.router_client import RouterClient
from pagedkv.stack import LocalStack, RouterProcess, WorkerProcess
from pagedkv_base.model_files import tiny_tokenizer
from tests.support.http import metric, openai_client

MODEL = "tiny-random"
BLOCK = 16
# Byte-level tokenizer: one token per byte, so each prefix is ~300 tokens (18 blocks).
PREFIXES = [
    f"System prompt {i}: " + f"you are a careful assistant number {i}. " * 8 for i in range(4)
]


@pytest.fixture(scope="module")
def stack():
    args = ["--num-blocks", "256", "--block-size", str(BLOCK), "--max-num-seqs", "8"]
    # With tokens: the workers call with the pools' token, the router with its own router token.
    with LocalStack(
        workers=2,
        model=MODEL,
        worker_args=args,
        router=True,
        startup_timeout=180,
        token="pools-token",
    ) as s:
        yield s


def _complete(url: str, prompt: str, salt: str | None = None, **kw):
    """(text, the worker that answered, the cached tokens the router saw there)."""
    extra = {"cache_salt": salt} if salt is not None else None
    raw = openai_client(url).completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra, **kw
    )
    return (
        raw.parse().choices[0].text,
        raw.headers.get("x-pagedkv-worker"),
        int(raw.headers.get("x-pagedkv-cached-tokens", "-1")),
    )


def _worker_id(stack: LocalStack, url: str) -> str:
    return stack.workers[stack.worker_urls.index(url)].worker_id


def test_the_openai_client_gets_the_same_greedy_text_as_from_a_worker(stack):
    router, worker = openai_client(stack.router_url), openai_client(stack.worker_urls[0])
    messages = [
        {"role": "system", "content": PREFIXES[0]},
        {"role": "user", "content": "Say something."},
    ]
    for c in (router, worker):
        assert [m.id for m in c.models.list().data] == [MODEL]
    want = worker.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    got = router.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    chunks = router.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == want.choices[0].message.content
    )
    text = (
        worker.completions.create(model=MODEL, prompt=PREFIXES[1], max_tokens=10, temperature=0)
        .choices[0]
        .text
    )
    streamed = router.completions.create(
        model=MODEL, prompt=PREFIXES[1], max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text
    with pytest.raises(openai.NotFoundError):
        router.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):  # the worker's own validation, passed through
        router.completions.create(model=MODEL, prompt="x", max_tokens=0)


def test_requests_land_on_the_worker_that_holds_their_prefix(stack):
    # Each prefix goes straight to one worker (bypassing the router), so only that pool holds it.
    owner = {}
    for i, prefix in enumerate(PREFIXES[2:4]):
        url = stack.worker_urls[i]
        openai_client(url).completions.create(
            model=MODEL, prompt=prefix + "warm up", max_tokens=1, temperature=0
        )
        owner[prefix] = _worker_id(stack, url)
    allocator = RouterClient(
        stack.allocator_address, router_token=(stack.log_dir / "router-token").read_text().strip()
    )
    pools = {p.worker_id: p for p in allocator.list_pools()}
    for prefix, wid in owner.items():
        for question in ("What now?", "And then?", "Why?"):
            text, worker, cached = _complete(stack.router_url, prefix + question)
            assert worker == wid
            # what the router saw is what the allocator says that pool holds
            fp = pools[wid].model_fingerprint
            # as the worker and the router tokenize
            ids = tiny_tokenizer().encode(prefix + question)
            held = {m.worker_id: m.cached_tokens for m in allocator.match_prefix(fp, ids)}
            assert cached == held[wid] >= (len(prefix) // BLOCK - 1) * BLOCK
    allocator.close()
    best = metric(
        stack.router_url, "pagedkv_router_prefix_best_cached_tokens_total", {"policy": "kv"}
    )
    chosen = metric(stack.router_url, "pagedkv_router_prefix_cached_tokens_total", {"policy": "kv"})
    assert chosen == best > 0


def test_the_view_from_events_routes_as_asking_match_prefix_does(stack):
    """The default router matches prompts in its copy of the pools' caches (kept
    from the allocator's events) and asks no MatchPrefix; a router asking
    MatchPrefix per request places every request the same and sees the same
    cached tokens."""
    asking = RouterProcess(
        "router-asking",
        allocator=stack.allocator_address,
        model=MODEL,
        args=["--log-level", "warning", "--router-token-file", str(stack.log_dir / "router-token")],
        env={"PAGEDKV_ROUTER_CACHE_VIEW": "match-prefix"},
    )
    prefixes = [
        f"View check {i}: " + "answer with care and cite the source. " * 8 for i in range(2)
    ]
    try:
        for prefix, url in zip(prefixes, stack.worker_urls, strict=True):  # each pool holds one
            openai_client(url).completions.create(
                model=MODEL, prompt=prefix + "warm", max_tokens=1, temperature=0
            )
        asking.start().wait_healthy(120)
        calls_before = metric(stack.router_url, "pagedkv_router_match_prefix_seconds_count")
        for prefix in prefixes:
            for question in ("Once more?", "Again?"):
                # Once, so that answering it again changes no pool; then both routers.
                _complete(asking.url, prefix + question)
                _, via_call, cached_call = _complete(asking.url, prefix + question)
                for _ in range(20):  # the view is late by its events' trip
                    _, via_view, cached_view = _complete(stack.router_url, prefix + question)
                    if (via_view, cached_view) == (via_call, cached_call):
                        break
                    time.sleep(0.05)
                assert (via_view, cached_view) == (via_call, cached_call) and cached_view > 0
        assert metric(stack.router_url, "pagedkv_router_prefix_views_synced") == 1
        assert metric(stack.router_url, "pagedkv_router_view_match_seconds_count") > 0
        assert metric(stack.router_url, "pagedkv_router_match_prefix_seconds_count") == calls_before
        assert metric(asking.url, "pagedkv_router_prefix_views_synced") == 0
        assert metric(asking.url, "pagedkv_router_match_prefix_seconds_count") == 8
    finally:
        asking.terminate()


def test_requests_arriving_together_with_a_new_prefix_land_on_one_worker(stack):
    """Before any pool holds the prefix (MatchPrefix sees it once computed), the
    router counts it on the worker computing it: the prefix is not cached twice."""
    prefix = "A tenant nobody has seen yet: " + "answer in French, briefly. " * 12
    with ThreadPoolExecutor(4) as pool:
        placed = list(
            pool.map(lambda i: _complete(stack.router_url, prefix + f"question {i}"), range(4))
        )
    assert len({worker for _, worker, _ in placed}) == 1, placed


def test_new_prefixes_spread_over_the_workers_and_the_recent_blocks_read_back(stack):
    """Through a router that has sent nothing yet, four prefixes no pool holds, one after
    another: two on each worker; each worker's `pagedkv_router_recent_blocks` reads back the
    whole blocks of the two sent there (each prompt's blocks before its last token)."""
    fresh = RouterProcess(
        "router-fresh",
        allocator=stack.allocator_address,
        model=MODEL,
        args=["--log-level", "warning", "--router-token-file", str(stack.log_dir / "router-token")],
    )
    prompts = [
        f"Spread check {i}: " + "reply in one short sentence, please. " * 8 + "Go."
        for i in range(4)
    ]
    try:
        fresh.start().wait_healthy(120)
        placed = [_complete(fresh.url, prompt)[1] for prompt in prompts]
        assert sorted(placed.count(w.worker_id) for w in stack.workers) == [2, 2], placed
        for w in stack.workers:
            sent = [p for p, on in zip(prompts, placed, strict=True) if on == w.worker_id]
            expected = sum((len(tiny_tokenizer().encode(p)) - 1) // BLOCK for p in sent)
            assert (
                metric(fresh.url, "pagedkv_router_recent_blocks", {"worker": w.worker_id})
                == expected
            )
    finally:
        fresh.terminate()


def test_cache_salts_do_not_attract_each_other(stack):
    prefix = "Tenant-private instructions: " + "keep everything confidential. " * 10
    text_a, worker_a, cached = _complete(stack.router_url, prefix + "first", salt="tenant-a")
    assert cached == 0
    _, again, cached = _complete(stack.router_url, prefix + "second", salt="tenant-a")
    assert again == worker_a and cached >= len(prefix) // BLOCK * BLOCK - BLOCK
    # The same text under another salt: nothing cached anywhere for it.
    for salt in ("tenant-b", None):
        _, _, cached = _complete(stack.router_url, prefix + "second", salt=salt)
        assert cached == 0
    # A salt the allocator would refuse matches nothing; the worker answers the error.
    for bad in (
        "\ud800",
        "s" * 1025,
    ):
        # JSON-escaped: a lone surrogate is valid JSON, not valid text
        body = json.dumps(
            {"model": MODEL, "prompt": prefix + "third", "max_tokens": 1, "cache_salt": bad}
        )
        r = httpx.post(
            f"{stack.router_url}/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_a_restarted_router_routes_as_before(stack):
    prefix = PREFIXES[2]  # held by worker-1 (test above)
    stack.router.terminate()
    # the same port: it learns everything from the allocator again
    stack.router.start().wait_healthy(120)
    _, worker, cached = _complete(stack.router_url, prefix + "after a restart")
    assert worker == "worker-1" and cached > 0


def test_a_worker_that_joins_is_used_without_restarting_the_router(stack):
    joined = WorkerProcess(
        "worker-joined",
        model=MODEL,
        allocator=stack.allocator_address,
        args=[
            "--log-level",
            "warning",
            "--num-blocks",
            "256",
            "--block-size",
            str(BLOCK),
            "--allocator-token-file",
            str(stack.log_dir / "allocator-token"),
        ],
    )
    try:
        joined.start().wait_healthy(120)
        deadline = time.monotonic() + 30
        while httpx.get(f"{stack.router_url}/health").json()["workers"] < 3:
            assert time.monotonic() < deadline, "the router never learned of the new worker"
            time.sleep(0.1)
        prefix = "A prompt only the new worker has seen. " * 8
        openai_client(joined.url).completions.create(
            model=MODEL, prompt=prefix + "hi", max_tokens=1, temperature=0
        )
        for question in ("one", "two"):
            _, worker, cached = _complete(stack.router_url, prefix + question)
            assert worker == "worker-joined" and cached > 0
    finally:
        joined.terminate()
    deadline = time.monotonic() + 30
    while httpx.get(f"{stack.router_url}/health").json()["workers"] != 2:
        # deregistered: dropped at once
        assert time.monotonic() < deadline, "the router kept a worker whose pool was dropped"
        time.sleep(0.1)


def test_a_killed_worker_is_routed_around_without_a_failed_request(stack):
    prefix = PREFIXES[3]  # held by worker-2 (test above), which the router prefers for it
    _, worker, _ = _complete(stack.router_url, prefix + "before")
    assert worker == "worker-2"
    retries_before = (
        metric(stack.router_url, "pagedkv_router_retries_total", {"reason": "unreachable"}) or 0
    )
    # A stream under way when its worker dies ends with an error event, not a silent cut.
    long = openai_client(stack.router_url).completions.create(
        model=MODEL,
        prompt=prefix + "long",
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(long))
    stack.workers[1].kill()  # its pool stays registered until its lease runs out
    with pytest.raises(openai.APIError, match="the worker failed mid-answer"):
        for _ in long:
            pass
    for i in range(4):
        text, worker, _ = _complete(stack.router_url, prefix + f"after {i}")
        assert worker == "worker-1" and text
        chunks = openai_client(stack.router_url).completions.create(
            model=MODEL, prompt=prefix + f"stream {i}", max_tokens=4, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks)
    assert (
        metric(stack.router_url, "pagedkv_router_retries_total", {"reason": "unreachable"})
        >= retries_before + 1
    )
    assert (
        metric(
            stack.router_url,
            "pagedkv_router_failed_requests_total",
            {"reason": "no_worker_available"},
        )
        is None
    )
    assert (
        metric(
            stack.router_url,
            "pagedkv_router_failed_requests_total",
            {"reason": "worker_failed_mid_answer"},
        )
        == 1
    )


def test_health_answers_while_big_prompts_are_tokenized(stack):
    """Six 2 MB prompts at once: the router parses and tokenizes each in a
    thread that lets go of the GIL, so /health keeps answering (the
    tokenizer held it for the whole text: /health waited up to 7 s here)."""
    body = {"model": MODEL, "prompt": "hello paged world, " * ((2 << 20) // 19), "max_tokens": 1}
    with ThreadPoolExecutor(6) as pool:
        posts = [
            pool.submit(httpx.post, f"{stack.router_url}/v1/completions", json=body, timeout=600)
            for _ in range(6)
        ]
        waits = []
        while not all(p.done() for p in posts):
            t0 = time.perf_counter()
            assert httpx.get(f"{stack.router_url}/health", timeout=600).status_code == 200
            waits.append(time.perf_counter() - t0)
            time.sleep(0.05)
        answers = [p.result() for p in posts]
    # the worker refuses a prompt longer than its model takes, in OpenAI's shape
    assert all(a.status_code == 400 and a.json()["error"]["param"] == "prompt" for a in answers)
    assert len(waits) > 5 and max(waits) < 3.0, max(waits)
