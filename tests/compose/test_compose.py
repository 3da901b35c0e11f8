"""`docker compose up`, for real: build the images, run docker-compose.yml on a
Docker engine and use the stack the way a user does (issue 16).

    python -m pytest -m compose -s        (as root; .ci/run runs it after `make test`)

1. Start a private engine (deploy/local-engine.sh; skipped, saying why, where
   none can start) unless PAGEDKV_COMPOSE_DOCKER_HOST names one to use.
2. Build every image with deploy/local-images.sh (no Docker Hub here: the base
   from debootstrap, Redis and Prometheus from Debian's packages, torch from
   the local wheel; PAGEDKV_COMPOSE_IMAGES=public builds from the public
   images instead), then `docker-compose build` and `up -d`; wait until every
   health check passes. Grafana stays out (its profile is off): no image of it
   can be had here.
3. Chat with each worker through its published port; one conversation whose
   second turn, on the other worker, loads its history from the shared store.
4.-6. The workload, the allocator restarted in the middle of it, Prometheus's
   series and `docker-compose down -v`: tests/compose/test_compose_workload.py,
   which runs after this file on the same stack (the engine and the stack are
   session fixtures of tests/compose/conftest.py; helpers: tests/support/compose.py).

Each step prints a `COMPOSE {...}` line with its timings.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.compose import (
    FRANCE,
    MODEL,
    SERVICES,
    WORKERS,
    chat,
    note,
    scrape,
)
from tests.support.drills import wait_for

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2400)]


# ------------------------------------------------------------------ the tests


def test_every_service_is_healthy_and_grafana_stays_for_users(stack):
    running = set(stack.compose("ps", "--services", "--filter", "status=running").stdout.split())
    assert running == SERVICES
    assert {svc: stack.health(svc) for svc in SERVICES} == {
        svc: "running/healthy" for svc in SERVICES
    }
    # Grafana is left out of this run by its profile only: it is still there for users.
    assert "grafana" in stack.compose("config", "--services").stdout.split()


def test_each_container_holds_its_own_credentials_only(stack):
    """No worker or router container can read the admin token, or another worker's token."""

    def held(service: str) -> set[str]:
        return set(
            stack.docker("exec", stack.container(service), "ls", "/credentials").stdout.split()
        )

    assert held("worker-1") == {"worker-1.token", "worker-1.store-key", "api-keys"}
    assert held("worker-2") == {"worker-2.token", "worker-2.store-key", "api-keys"}
    assert held("router") == {"router-token", "api-keys"}
    assert "admin-token" in held("allocator")


def test_the_api_wants_the_generated_key(stack):
    """Without the key the router and each worker answer 401; with it, 200."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    for name in ("router", *WORKERS):
        url = f"{stack.url(name)}/v1/completions"
        assert httpx.post(url, json=body, timeout=300).status_code == 401, name
        wrong = {"Authorization": "Bearer sk-not-the-key"}
        assert httpx.post(url, json=body, headers=wrong, timeout=300).status_code == 401, name
        assert httpx.post(url, json=body, headers=stack.auth, timeout=300).status_code == 200


def test_chat_with_each_worker_through_its_published_port(stack):
    for worker in (*WORKERS, "router"):  # the router: the one port published by docker-compose.yml
        t0 = time.monotonic()
        answers = [
            chat(stack.url(worker), FRANCE, key=stack.api_key, max_tokens=24, stream=stream)
            for stream in (False, True)
        ]
        for a in answers:
            assert a["status"] == 200 and a["text"].strip(), a
            if MODEL == "smollm2":  # the reference pair (/work/shared/ENVIRONMENT.md): greedy, fp32
                assert (a["text"], a["finish"]) == ("The capital of France is Paris.", "stop"), a
        assert answers[0]["text"] == answers[1]["text"]  # streamed or not, the same reply
        note(
            "chat",
            worker=worker,
            port=stack.ports[worker],
            text=answers[0]["text"],
            seconds=round(time.monotonic() - t0, 2),
        )


def tier_total(base: str, name: str, tier: str) -> float:
    return sum(
        v for (n, labels), v in scrape(base).items() if n == name and ("tier", tier) in labels
    )


def test_one_conversation_across_both_workers_is_cached_on_the_second(stack):
    """Turn 1 on worker-1, turn 2 (its whole history plus a question) on
    worker-2: worker-2 loads the history worker-1 computed from the shared
    store (the `kv-store` volume), and counts it in `cached_tokens`."""
    messages = [
        {"role": "system", "content": "You are a tutor for the solar system. " * 8},
        {"role": "user", "content": "Which planet is the largest? One sentence."},
    ]

    def turn(worker: str) -> dict:
        r = httpx.post(
            f"{stack.url(worker)}/v1/chat/completions",
            headers=stack.auth,
            timeout=300,
            json={"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        return r.json()

    saved_before = tier_total(
        stack.url("worker-1"), "pagedkv_worker_kv_tier_saved_blocks_total", "shared"
    )
    first = turn("worker-1")
    # Freed, its blocks are written through to the store; the allocator finds them once
    # worker-1 reports the saves, in the step it sends right after (the count then stays).
    last = [None]

    def saves_settled():
        n = tier_total(stack.url("worker-1"), "pagedkv_worker_kv_tier_saved_blocks_total", "shared")
        settled, last[0] = n > saved_before and n == last[0], n
        return settled

    wait_for(saves_settled, 60, "worker-1's store saves", interval_s=0.5)
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the smallest?"},
    ]
    hits_before = tier_total(
        stack.url("worker-2"), "pagedkv_worker_kv_tier_hit_tokens_total", "shared"
    )
    second = turn("worker-2")
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # turn 1's prompt, whole blocks: a prefix of turn 2's
    whole_blocks = first["usage"]["prompt_tokens"] // 16 * 16
    hits = (
        tier_total(stack.url("worker-2"), "pagedkv_worker_kv_tier_hit_tokens_total", "shared")
        - hits_before
    )
    note(
        "conversation across workers",
        first_prompt=first["usage"]["prompt_tokens"],
        second_prompt=second["usage"]["prompt_tokens"],
        cached_on_second=cached,
        store_hit_tokens=hits,
    )
    assert cached >= whole_blocks > 0 and hits == cached


def test_a_fresh_worker_container_finds_the_attention_kernel_compiled(stack):
    """The image carries the CPU attention kernel compiled (deploy/Dockerfile):
    a new container from it loads both builds from numba's cache and
    compiles neither (cold, that is ~6 s at every container's start)."""
    image = stack.docker(
        "inspect", "-f", "{{.Config.Image}}", stack.container(WORKERS[0])
    ).stdout.strip()
    code = (
        "from worker.attention import cpu_decode as cd\n"
        "cd.compile_kernels(parallel=True)\n"
        "print(*(sum(getattr(b.stats, c).values()) for c in ('cache_misses', 'cache_hits')"
        " for b in (cd._serial, cd._parallel)))\n"
    )
    out = stack.docker(
        "run", "--rm", "--entrypoint", "python", image, "-c", code, timeout=180
    ).stdout.split()
    assert out == ["0", "0", "1", "1"], f"cache misses (serial, parallel), then hits: {out}"
