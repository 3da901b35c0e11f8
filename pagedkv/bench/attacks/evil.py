"""An evil worker behind the router: huge and trickled answers."""

from __future__ import annotations

import contextlib
import json
import time

from pagedkv.bench.attacks.target import (
    ATTACKER,
    EVIL_MODEL,
    TRICKLE_SLACK_S,
    Sampler,
    Target,
    metric,
    running,
)
from pagedkv.bench.workloads import AttackWorkload


def evil_worker(t: Target, w: AttackWorkload) -> contextlib.AbstractContextManager[dict]:
    def work() -> dict:
        import concurrent.futures

        import psutil

        from pagedkv.bench.attackers import BadWorker, rogue_pool

        timeout = w.router_first_byte_timeout_s
        sampler = Sampler(t.stack.router.pid)
        workers = len(t.stack.worker_urls)
        try:
            with BadWorker(
                "by-prompt",
                sock=t.attacker_socket.dup(),
                huge_bytes=w.evil_answer_mb << 20,
                model=EVIL_MODEL,
            ) as evil:
                pool = rogue_pool(
                    t.allocator, ATTACKER, t.attacker_url, EVIL_MODEL, t.attacker_token
                )
                evil.identity = pool.identity
                try:
                    deadline = time.monotonic() + 30
                    while metric(t.router, "pagedkv_router_workers") < workers + 1:
                        if time.monotonic() > deadline:
                            raise RuntimeError(
                                "the router did not prove the evil worker's pool within 30 s"
                            )
                        time.sleep(0.1)
                    rss_before = psutil.Process(t.stack.router.pid).memory_info().rss / 2**20
                    t0 = time.monotonic()
                    with concurrent.futures.ThreadPoolExecutor(w.evil_answers) as ex:
                        passed = list(
                            ex.map(lambda _: _evil_answer(t.router), range(w.evil_answers))
                        )
                    rss_peak, _ = sampler.peak(t0, time.monotonic())
                    with concurrent.futures.ThreadPoolExecutor(2) as ex:
                        whole, stream = ex.map(
                            lambda s: _trickled(t.router, s, 3 * timeout + 30), (False, True)
                        )
                finally:
                    pool.close()
        finally:
            sampler.stop()
        held = timeout + TRICKLE_SLACK_S
        return {
            "answers": w.evil_answers,
            "answer_mb": w.evil_answer_mb,
            "mb_passed_each": [round(b / 2**20, 1) for b in passed],
            "router_rss_mib_before": round(rss_before, 1),
            "router_rss_mib_peak": rss_peak,
            "first_byte_timeout_s": timeout,
            "trickled_whole": whole,
            "trickled_stream": stream,
            "reached": (rss_peak or 0) - rss_before >= w.evil_answer_mb
            or whole["seconds"] > held
            or whole["ended"] != "504 worker_timeout"
            or stream["seconds"] > held
            or stream["ended"] != "worker_timeout",
        }

    return running(work)


def _evil_answer(router: str) -> int:
    """Bytes of an evil worker's huge answer that reached the client through the router."""
    import httpx

    got = 0
    with (
        contextlib.suppress(httpx.HTTPError),
        httpx.stream(
            "POST",
            f"{router}/v1/completions",
            timeout=120,
            json={"model": EVIL_MODEL, "prompt": "huge"},
        ) as r,
    ):
        for chunk in r.iter_raw():
            got += len(chunk)
    return got


def _trickled(router: str, stream: bool, limit_s: float) -> dict:
    """An evil worker's answer trickled a byte at a time after its status, through the
    router: how long the client was held and how it ended (a whole answer's status and
    error code; a stream's last error event's code, or "cut", "done", "timeout")."""
    import httpx

    body = {
        "model": EVIL_MODEL,
        "prompt": "trickle-stream" if stream else "trickle",
        "stream": stream,
    }
    t0 = time.monotonic()
    try:
        if not stream:
            r = httpx.post(f"{router}/v1/completions", json=body, timeout=limit_s)
            code = (
                r.json().get("error", {}).get("code")
                if r.headers.get("content-type", "").startswith("application/json")
                else None
            )
            ended = f"{r.status_code} {code}"
        else:
            ended = "cut"
            with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=limit_s) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        ended = "done" if ended == "cut" else ended
                    elif line.startswith("data: {") and '"error"' in line:
                        ended = str(json.loads(line[len("data: ") :])["error"].get("code"))
    except httpx.TimeoutException:
        ended = "timeout"
    except (httpx.HTTPError, ValueError) as exc:
        ended = f"error: {exc!r}"[:120]
    return {"seconds": round(time.monotonic() - t0, 2), "ended": ended}
