"""The worker tells the truth and sheds waste, on real processes
(docs/reliability.md, "Workers and the router under load and faults").

- A multi-megabyte body (just under the 8 MiB limit) does not stop /health:
  text and chat prompts that must be too long are refused before they are
  tokenized, bodies are parsed in a thread. The worst /health latency per
  body is printed and asserted under a bound that cannot flake (1 s).
- A client that hangs up on a non-streaming request aborts it: the abort is
  counted and its KV blocks are freed.
- The allocator killed: /health turns 503 with a JSON reason (also while
  idle), requests in flight fail after the give-up time with a 503 (a stream
  with an error event and [DONE]), new ones are refused with a 503 at once,
  and none of these bodies carries a gRPC debug string; the allocator back:
  /health 200 and the fault-free text again.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from tests.support.drills import MODEL, Stack, report, scrape, wait_for
from tests.support.drills import reference_texts as offline

LIMIT = 8 << 20
LEAKS = ("debug_error_string", "_InactiveRpcError", "StatusCode.", "grpc_status", "<_")


def _worst_health_while(url: str, send) -> tuple[float, int, object]:
    """Run `send()` in a thread and GET /health meanwhile;
    (worst latency, probes, send's result)."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", send()))
    thread.start()
    worst, probes = 0.0, 0
    while thread.is_alive() or probes < 3:
        t0 = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        probes += 1
        time.sleep(0.02)
    thread.join()
    return worst, probes, result.get("r")


def test_health_answers_under_multi_megabyte_bodies(worker_process):
    with worker_process(
        "--model", MODEL, "--num-blocks", "256", "--block-size", "4", "--max-model-len", "512"
    ) as url:
        words = "word " * ((LIMIT - 300) // 5)
        bodies = {
            "completion, 8 MiB text prompt": (
                "completions",
                {"model": MODEL, "prompt": words, "max_tokens": 4},
            ),
            "chat, 8 MiB message": (
                "chat/completions",
                {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": words}]},
            ),
            "completion, 4.2 M token ids": (
                "completions",
                {"model": MODEL, "max_tokens": 4, "prompt": [7] * ((LIMIT - 300) // 2)},
            ),
        }
        figures = {}
        for name, (route, body) in bodies.items():
            raw = json.dumps(body, separators=(",", ":")).encode()
            assert LIMIT - 400_000 < len(raw) <= LIMIT, (name, len(raw))
            t0 = time.monotonic()

            def send(route=route, raw=raw):
                return httpx.post(
                    f"{url}/v1/{route}",
                    content=raw,
                    timeout=120,
                    headers={"content-type": "application/json"},
                )

            worst, probes, r = _worst_health_while(url, send)
            assert r.status_code == 400, r.text[:300]
            assert "leaving no room to generate" in r.json()["error"]["message"]
            figures[name] = {
                "bytes": len(raw),
                "answered_s": round(time.monotonic() - t0, 3),
                "health_probes": probes,
                "health_worst_ms": round(worst * 1000, 1),
            }
            assert worst < 1.0, figures[name]
        # And the worker still serves.
        ok = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": "still here",
                "max_tokens": 3,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert ok.status_code == 200
        report("worker_health_under_big_bodies", figures)


def test_disconnected_non_streaming_request_is_aborted(worker_process):
    with worker_process(
        "--model", MODEL, "--num-blocks", "512", "--block-size", "4", "--max-model-len", "2048"
    ) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": "a very long answer",
                "max_tokens": 2000,
                "temperature": 0,
                "ignore_eos": True,
            }
        ).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        wait_for(
            lambda: httpx.get(f"{url}/health").json()["running"] == 1,
            60,
            "the request to run",
            0.01,
        )
        t0 = time.monotonic()
        sock.close()  # the client hangs up while its request generates

        def aborted():
            m = scrape(f"{url}/metrics")
            return (
                m.value("pagedkv_worker_requests_total", finish_reason="abort") == 1
                and m.value("pagedkv_worker_running_sequences") == 0
                and m.value("pagedkv_worker_kv_blocks_used") == 0
            ) and m

        m = wait_for(aborted, 30, "the abort and the blocks freed", 0.05)
        seconds = time.monotonic() - t0
        assert m.value("pagedkv_worker_requests_total", finish_reason="length") == 0
        assert m.value("pagedkv_worker_generation_tokens_total") < 2000
        report(
            "worker_disconnect_aborts",
            {
                "abort_seen_after_hangup_s": round(seconds, 3),
                "max_tokens": 2000,
                "tokens_generated": m.value("pagedkv_worker_generation_tokens_total"),
            },
        )


def _no_leak(text: str) -> None:
    for needle in LEAKS:
        assert needle not in text, text


def test_allocator_unreachable_health_give_up_and_recovery():
    unhealthy_after, give_up_after = 1.0, 4.0
    prompt, max_tokens = "the allocator is gone", 6
    timeouts = {
        "PAGEDKV_WORKER_ALLOCATOR_UNHEALTHY_AFTER": str(unhealthy_after),
        "PAGEDKV_WORKER_ALLOCATOR_GIVE_UP_AFTER": str(give_up_after),
    }
    with Stack(
        workers=1,
        redis=False,
        worker_args=["--num-blocks", "1024", "--block-size", "4"],
        env=timeouts,
    ) as stack:
        url = stack.worker_urls[0]
        assert httpx.get(f"{url}/health").status_code == 200
        long = {
            "model": MODEL,
            "prompt": "a long one",
            "max_tokens": 1900,
            "temperature": 0,
            "ignore_eos": True,
        }
        answers: dict = {}

        def whole():
            answers["whole"] = httpx.post(f"{url}/v1/completions", json=long, timeout=120)

        def streamed():
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=120
            ) as r:
                answers["stream_status"] = r.status_code
                answers["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        wait_for(
            lambda: httpx.get(f"{url}/health").json()["running"] == 2, 60, "both requests to run"
        )
        stack.kill_allocator()
        killed = time.monotonic()

        # /health says 503 with a reason once past PAGEDKV_WORKER_ALLOCATOR_UNHEALTHY_AFTER.
        sick = wait_for(
            lambda: (r := httpx.get(f"{url}/health", timeout=5)).status_code == 503 and r,
            30,
            "/health to say 503",
        )
        unhealthy_s = time.monotonic() - killed
        reason = sick.json()
        assert reason["status"] == "unavailable" and reason["code"] == "allocator_unreachable"
        assert "has not answered" in reason["reason"]
        _no_leak(sick.text)

        # In flight: a 503 and a stream that ends with an error, after the give-up time.
        for t in threads:
            t.join(timeout=60)
        gave_up_s = time.monotonic() - killed
        whole_r = answers["whole"]
        assert whole_r.status_code == 503, whole_r.text
        error = whole_r.json()["error"]
        assert error["code"] == "allocator_unreachable" and error["type"] == "server_error"
        _no_leak(whole_r.text)
        assert answers["stream_status"] == 200 and answers["events"][-1] == "data: [DONE]"
        last = json.loads(answers["events"][-2].removeprefix("data: "))
        assert last["error"]["code"] == "allocator_unreachable"
        _no_leak("\n".join(answers["events"]))

        # New requests are refused at once while the allocator stays away.
        t0 = time.monotonic()
        refused = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2},
            timeout=30,
        )
        refused_s = time.monotonic() - t0
        assert (
            refused.status_code == 503
            and refused.json()["error"]["code"] == "allocator_unreachable"
        )
        _no_leak(refused.text)

        # Back: /health 200 again (the pool was in memory: a new epoch), and the fault-free text.
        stack.start_allocator()
        back = time.monotonic()
        wait_for(
            lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200,
            60,
            "/health to say 200",
        )
        recovered_s = time.monotonic() - back
        ok = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == offline([prompt], max_tokens)[0]

        # Idle: the worker probes, so /health tells the truth without traffic.
        stack.wait_idle()
        stack.kill_allocator()
        idle_killed = time.monotonic()
        wait_for(
            lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503,
            30,
            "idle /health to say 503",
        )
        idle_unhealthy_s = time.monotonic() - idle_killed
        stack.start_allocator()
        wait_for(
            lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200,
            60,
            "idle /health to say 200",
        )

        m = scrape(f"{url}/metrics")
        report(
            "worker_allocator_unreachable",
            {
                "unhealthy_after_flag_s": unhealthy_after,
                "give_up_after_flag_s": give_up_after,
                "kill_to_503_s": round(unhealthy_s, 2),
                "kill_to_requests_failed_s": round(gave_up_s, 2),
                "new_request_refused_in_s": round(refused_s, 3),
                "restart_to_200_s": round(recovered_s, 2),
                "idle_kill_to_503_s": round(idle_unhealthy_s, 2),
                "requests_aborted": m.value("pagedkv_worker_requests_total", finish_reason="abort"),
            },
        )
