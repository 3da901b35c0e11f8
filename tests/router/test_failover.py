"""The router's failure rules against workers that misbehave on the wire:
a worker that answers 503, or drops the connection in the middle of a whole
(non-stream) answer, is skipped before anything reaches the client, and the
request is answered by the next worker; one that drops a stream after its
first event ends the client's stream with an OpenAI-shaped error event.
And a client that hangs up on the router, stream or not, has its request
aborted on the worker (its blocks freed) as if it had hung up there.

The misbehaving worker is a real TCP server on a loopback port speaking
just enough HTTP/1.1 to fail in one chosen way; the good worker is a real
tiny-random worker; the router is a real process with a static list."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import time

import httpx
import openai
import psutil
import pytest

from pagedkv.bench.attackers import BadWorker, read_to_close, slow_clients
from pagedkv.stack import RouterProcess
from tests.support.drills import scrape, wait_for
from tests.support.http import metric

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def good_worker(worker_process):
    with worker_process(
        "--model", MODEL, "--num-blocks", "512", "--block-size", "4", "--max-model-len", "2048"
    ) as url:
        yield url


def _router(*urls: str, env: dict[str, str] | None = None) -> RouterProcess:
    # round-robin: each of two workers first in turn, whatever they hold
    return (
        RouterProcess(
            model=MODEL,
            args=["--workers", ",".join(urls), "--policy", "round-robin", "--log-level", "warning"],
            env=env,
        )
        .start()
        .wait_healthy(120)
    )


def _complete(url: str, **kw):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    return client.completions.with_raw_response.create(
        model=MODEL, prompt="Hello there", max_tokens=6, temperature=0, **kw
    )


@pytest.mark.parametrize("mode, reason", [("503", "unavailable"), ("drop-body", "unreachable")])
def test_a_failing_worker_is_skipped_before_the_client_sees_a_byte(good_worker, mode, reason):
    expected = _complete(good_worker).parse().choices[0].text
    with BadWorker(mode) as bad:
        router = _router(bad.url, good_worker)
        try:
            for _ in range(4):
                raw = _complete(router.url)
                assert raw.parse().choices[0].text == expected
                assert raw.headers["x-pagedkv-worker"] == good_worker
            assert bad.posts >= 1  # it was tried, and failed, and nobody noticed
            retries = metric(router.url, "pagedkv_router_retries_total", {"reason": reason})
            assert retries == bad.posts
        finally:
            router.terminate()


def test_a_stream_cut_after_its_first_event_ends_with_an_error_event(good_worker):
    with BadWorker("drop-stream") as bad:
        router = _router(bad.url)
        try:
            with httpx.stream(
                "POST",
                f"{router.url}/v1/completions",
                timeout=60,
                json={"model": MODEL, "prompt": "Hello", "max_tokens": 6, "stream": True},
            ) as r:
                assert r.status_code == 200
                events = [
                    line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")
                ]
            assert json.loads(events[0])["choices"][0]["text"] == "partial"
            assert json.loads(events[1])["error"]["code"] == "worker_failed"
            assert events[2:] == ["[DONE]"]
            failed = metric(
                router.url,
                "pagedkv_router_failed_requests_total",
                {"reason": "worker_failed_mid_answer"},
            )
            assert failed == 1
        finally:
            router.terminate()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_on_the_router_aborts_its_request_on_the_worker(good_worker, stream):
    before = (
        scrape(f"{good_worker}/metrics").value(
            "pagedkv_worker_requests_total", finish_reason="abort"
        )
        or 0
    )
    router = _router(good_worker)
    try:
        host, port = router.url.removeprefix("http://").split(":")
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": "a very long answer",
                "max_tokens": 2000,
                "temperature": 0,
                "ignore_eos": True,
                "stream": stream,
            }
        ).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        wait_for(
            lambda: httpx.get(f"{good_worker}/health").json()["running"] == 1,
            60,
            "the request to run",
            0.01,
        )
        time.sleep(0.2)  # generating
        sock.close()  # the client hangs up on the router

        def aborted():
            m = scrape(f"{good_worker}/metrics")
            return (
                m.value("pagedkv_worker_requests_total", finish_reason="abort") == before + 1
                and m.value("pagedkv_worker_running_sequences") == 0
                and m.value("pagedkv_worker_kv_blocks_used") == 0
            ) and m

        wait_for(aborted, 30, "the abort on the worker and its blocks freed", 0.05)
        assert metric(router.url, "pagedkv_router_in_flight_requests", {"worker": good_worker}) == 0
    finally:
        router.terminate()


def test_a_worker_that_took_the_request_and_stays_silent_is_a_504_not_a_retry():
    """Another worker would compute the whole request again (a batch of 100
    prompts, n=64, made every worker compute it for a minute in turn)."""
    with BadWorker("silent") as first, BadWorker("silent") as second:
        router = _router(first.url, second.url, env={"PAGEDKV_ROUTER_FIRST_BYTE_TIMEOUT": "1.5"})
        try:
            t0 = time.monotonic()
            r = httpx.post(
                f"{router.url}/v1/completions",
                timeout=60,
                json={"model": MODEL, "prompt": "Hello", "max_tokens": 6},
            )
            assert r.status_code == 504 and r.json()["error"]["code"] == "worker_timeout"
            assert time.monotonic() - t0 < 20  # one first-byte timeout, not one per worker
            assert first.posts + second.posts == 1
        finally:
            router.terminate()


def test_a_worker_that_trickles_its_answer_is_cut_off():
    """A worker that sends its status, then a byte at a time: a whole answer is a 504
    within the timeout; a stream that never completes an event ends with an error event."""
    env = {"PAGEDKV_ROUTER_FIRST_BYTE_TIMEOUT": "1.5"}
    with BadWorker("trickle") as whole, BadWorker("trickle-stream") as streaming:
        first, second = _router(whole.url, env=env), _router(streaming.url, env=env)
        try:
            t0 = time.monotonic()
            r = httpx.post(
                f"{first.url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "a"}
            )
            assert r.status_code == 504 and r.json()["error"]["code"] == "worker_timeout"
            assert time.monotonic() - t0 < 20 and whole.posts == 1
            with httpx.stream(
                "POST",
                f"{second.url}/v1/completions",
                timeout=60,
                json={"model": MODEL, "prompt": "b", "stream": True},
            ) as r:
                assert r.status_code == 200
                events = [
                    line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")
                ]
            assert streaming.posts == 1 and time.monotonic() - t0 < 40
            assert (
                json.loads(events[-2])["error"]["code"] == "worker_timeout"
                and events[-1] == "[DONE]"
            )
            for router in (first, second):
                assert (
                    metric(
                        router.url,
                        "pagedkv_router_failed_requests_total",
                        {"reason": "worker_timeout"},
                    )
                    == 1
                )
        finally:
            first.terminate()
            second.terminate()


def test_a_worker_answering_without_end_cannot_fill_the_routers_memory():
    """Four 300 MB answers at once (one legal request can make a 112 MB one): the router
    holds a chunk of each, not the whole, and cuts each at its bound; an answer that
    declares its size over the bound is a 502 at once."""
    env = {"PAGEDKV_ROUTER_MAX_ANSWER_MB": "64"}
    with BadWorker("huge") as endless, BadWorker("huge-declared") as declared:
        router, other = _router(endless.url, env=env), _router(declared.url, env=env)
        try:
            r = httpx.post(
                f"{other.url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "x"}
            )
            assert r.status_code == 502 and r.json()["error"]["code"] == "worker_answer_too_large"
            assert declared.posts == 1
            proc = psutil.Process(router.pid)
            before = proc.memory_info().rss

            def fetch() -> int:
                got = 0
                with (
                    contextlib.suppress(httpx.HTTPError),
                    httpx.stream(
                        "POST",
                        f"{router.url}/v1/completions",
                        timeout=60,
                        json={"model": MODEL, "prompt": "x"},
                    ) as answer,
                ):
                    for chunk in answer.iter_raw():
                        got += len(chunk)
                return got

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda _: fetch(), range(4)))
            assert all(0 < g <= 65 << 20 for g in got), got  # cut at the bound, not passed on whole
            assert proc.memory_info().rss - before < 200 << 20
            assert endless.posts == 4
            assert (
                metric(
                    router.url,
                    "pagedkv_router_failed_requests_total",
                    {"reason": "worker_answer_too_large"},
                )
                == 4
            )
        finally:
            router.terminate()
            other.terminate()


def test_a_request_asking_for_too_many_sequences_is_a_400_before_any_worker(good_worker):
    router = _router(good_worker)
    try:
        body = {"model": MODEL, "prompt": ["Hello"] * 100, "n": 64, "max_tokens": 6}
        for url in (router.url, good_worker):
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text[:300]
            assert "at most 512 sequences" in r.json()["error"]["message"]
        assert metric(router.url, "pagedkv_router_requests_total") is None  # no worker was sent it
    finally:
        router.terminate()


def test_slow_clients_are_cut_off_and_health_answers(good_worker):
    """A client that sends its head or its body a byte at a time is closed
    after the deadline (21k of them exhausted the router's descriptors)."""
    router = _router(
        good_worker, env={"PAGEDKV_ROUTER_HEADER_TIMEOUT": "1", "PAGEDKV_ROUTER_BODY_TIMEOUT": "2"}
    )
    try:
        heads, bodies = slow_clients(router.url, 20, 20)
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
        t0 = time.monotonic()
        for sock in heads + bodies:
            read_to_close(sock)  # closed by the router
            sock.close()
        assert time.monotonic() - t0 < 15  # deadlines of 1 s and 2 s, not the client's patience
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
    finally:
        router.terminate()
