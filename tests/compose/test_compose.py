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
4. A workload on both workers with pools small enough to preempt, run twice:
   once undisturbed, once with `docker-compose restart allocator` in the
   middle. Every request completes, with the same text, and the allocator
   comes back with the same pools from its Redis journal (nothing recomputed).
5. Prometheus scrapes utilisation and preemption series from every target.
6. `docker-compose down -v` leaves no container, network or volume behind.

Each step prints a `COMPOSE {...}` line with its timings.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pagedkv.stack import free_port
from tests.support.drills import wait_for

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "deploy" / "local-engine.sh"
LOCAL_IMAGES = ROOT / "deploy" / "local-images.sh"
PROJECT = "pagedkv-compose-test"
# grafana: profile off
SERVICES = {"redis", "allocator", "worker-1", "worker-2", "router", "prometheus"}
WORKERS = ("worker-1", "worker-2")
MODEL = os.environ.get("PAGEDKV_COMPOSE_MODEL", "smollm2")
# SmolLM2-135M in fp32 keeps 45 KiB of K/V per token: 8 MiB is 11 blocks of 16
# tokens, so six requests of ~80 tokens at once on a worker must preempt.
KV_CACHE_MEMORY = os.environ.get("PAGEDKV_COMPOSE_KV_CACHE_MEMORY", "8MiB")
HEALTHY_TIMEOUT_S = 420.0

FRANCE = "What is the capital of France? Answer in one sentence."
PROMPTS = [
    "Name three colours of the rainbow.",
    "What is a paged KV cache?",
    "Write one sentence about the sea.",
    "Count from one to ten in words.",
    "Why is the sky blue?",
    "Give me a word that rhymes with cat.",
]
MAX_TOKENS = 40


def note(step: str, **figures) -> None:
    print(f"COMPOSE {json.dumps({'step': step, **figures})}", flush=True)


def run(
    cmd: list[str], *, env: dict[str, str], timeout: float, check: bool = True
) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited "
            f"{proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def docker_host():
    """DOCKER_HOST of an engine: PAGEDKV_COMPOSE_DOCKER_HOST's, or a private one
    started here (and stopped at the end, if it was not running already)."""
    given = os.environ.get("PAGEDKV_COMPOSE_DOCKER_HOST")
    for tool, package in (("docker", "docker.io"), ("docker-compose", "docker-compose")):
        if shutil.which(tool) is None:
            pytest.skip(
                f"skipped: no `{tool}` on PATH (Debian package {package}; .ci/run installs it)"
            )
    if given:
        yield given
        return
    if os.geteuid() != 0:
        pytest.skip(
            "skipped: starting a Docker engine needs root (or set PAGEDKV_COMPOSE_DOCKER_HOST)"
        )
    if shutil.which("dockerd") is None:
        pytest.skip("skipped: no `dockerd` on PATH (Debian package docker.io; .ci/run installs it)")
    env = os.environ.copy()
    already = (
        subprocess.run([str(ENGINE), "status"], env=env, capture_output=True, timeout=30).returncode
        == 0
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(ENGINE), "start"], env=env, capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        pytest.skip(
            f"skipped: no Docker engine could start on this machine: {proc.stderr.strip()[-800:]}"
        )
    [host] = re.findall(r"^DOCKER_HOST=(\S+)$", proc.stdout, re.M)
    note("engine", started=not already, docker_host=host, start_s=round(time.monotonic() - t0, 1))
    try:
        yield host
    finally:
        if not already:
            subprocess.run([str(ENGINE), "stop"], env=env, timeout=120)


# ------------------------------------------------------------------ the stack


@dataclass
class Stack:
    env: dict[str, str]
    env_file: Path | None
    ports: dict[str, int]
    private_engine: bool
    timings: dict[str, float] = field(default_factory=dict)
    down: bool = False
    api_key: str = ""  # the clients' key, generated by the credentials service

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def compose(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess:
        head = (
            ["docker-compose", "--env-file", str(self.env_file)]
            if self.env_file
            else ["docker-compose"]
        )
        return run([*head, *args], env=self.env, timeout=timeout, check=check)

    def docker(
        self, *args: str, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess:
        return run(["docker", *args], env=self.env, timeout=timeout, check=check)

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service, timeout=60).stdout.strip()

    def health(self, service: str) -> str:
        cid = self.container(service)
        if not cid:
            return "absent"
        return self.docker(
            "inspect",
            "-f",
            "{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}",
            cid,
        ).stdout.strip()

    def logs(self, service: str) -> str:
        proc = self.docker("logs", self.container(service), timeout=60)
        return proc.stdout + proc.stderr

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def left_behind(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        return {
            kind: self.docker(*cmd, "--filter", label, "-q").stdout.split()
            for kind, cmd in (
                ("containers", ("ps", "-a")),
                ("networks", ("network", "ls")),
                ("volumes", ("volume", "ls")),
            )
        }


@pytest.fixture(scope="module")
def stack(docker_host, tmp_path_factory):
    ports = {name: free_port() for name in (*WORKERS, "router", "prometheus")}
    # Workers are internal in docker-compose.yml (clients use the router); this
    # test also talks to each directly, so an override publishes them on loopback.
    override = tmp_path_factory.mktemp("override") / "publish-workers.yml"
    override.write_text(
        "services:\n"
        + "".join(f'  {w}:\n    ports: ["127.0.0.1:{ports[w]}:8000"]\n' for w in WORKERS)
    )
    env = {
        **os.environ,
        "DOCKER_HOST": docker_host,
        "COMPOSE_PROJECT_NAME": PROJECT,
        # Grafana out: no image of it here (its profile, not removed for users)
        "COMPOSE_PROFILES": "",
        "PAGEDKV_WORKER_MODEL": MODEL,
        "PAGEDKV_WORKER_KV_CACHE_MEMORY": KV_CACHE_MEMORY,
        "PAGEDKV_WORKER_THREADS": "1",  # two workers, two cores
        "PAGEDKV_WORKER_KV_OFFLOADING_SIZE": "0.25",  # GiB of host tier each
        "COMPOSE_FILE": f"{ROOT / 'docker-compose.yml'}{os.pathsep}{override}",
        "PAGEDKV_ROUTER_PORT": f"127.0.0.1:{ports['router']}",
        "PROMETHEUS_PORT": f"127.0.0.1:{ports['prometheus']}",
    }
    env_file = None
    s = Stack(env, None, ports, private_engine=not os.environ.get("PAGEDKV_COMPOSE_DOCKER_HOST"))

    t0 = time.monotonic()
    if os.environ.get("PAGEDKV_COMPOSE_IMAGES") != "public":
        env_file = tmp_path_factory.mktemp("compose") / "local.env"
        # its progress lines go to our stdout (pytest -s shows them as they come)
        proc = subprocess.run(
            [str(LOCAL_IMAGES)],
            env={**env, "PAGEDKV_LOCAL_ENV": str(env_file)},
            cwd=ROOT,
            stdout=sys.stdout,
            stderr=sys.stderr,
            timeout=1500,
        )
        assert proc.returncode == 0, "deploy/local-images.sh failed (its output is above)"
        s.env_file = env_file
    s.timings["images_s"] = round(time.monotonic() - t0, 1)
    # what an interrupted run may have left
    s.compose("down", "-v", "--remove-orphans", timeout=180)

    t0 = time.monotonic()
    s.compose("build", timeout=1500)
    s.timings["compose_build_s"] = round(time.monotonic() - t0, 1)
    note("build", **s.timings)
    try:
        t0 = time.monotonic()
        s.compose("up", "-d", "--no-build", timeout=600)
        s.timings["up_s"] = round(time.monotonic() - t0, 1)

        def all_healthy():
            states = {svc: s.health(svc) for svc in SERVICES}
            bad = {
                k: v
                for k, v in states.items()
                if v.startswith(("exited", "dead")) or v.endswith("unhealthy")
            }
            assert not bad, f"services failed: {bad}\n" + "\n".join(
                f"--- {k}\n{s.logs(k)[-2000:]}" for k in bad
            )
            return all(v == "running/healthy" for v in states.values())

        wait_for(all_healthy, HEALTHY_TIMEOUT_S, "every health check to pass", interval_s=2)
        s.timings["up_to_healthy_s"] = round(time.monotonic() - t0, 1)
        # where the compose file's header tells a user to read it
        s.api_key = s.compose(
            "run", "--rm", "--entrypoint", "cat", "credentials", "/credentials/api-keys"
        ).stdout.strip()
        note("up", **{k: v for k, v in s.timings.items() if k.startswith("up")})
        yield s
    finally:
        if not s.down:
            for svc in SERVICES:
                if s.container(svc):
                    print(f"--- {svc} (last lines)\n{s.logs(svc)[-1500:]}", flush=True)
            s.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
        if s.private_engine:
            # the images stay (the next run is warm); superseded builds of them go
            s.docker("image", "prune", "-f", timeout=300, check=False)


# ------------------------------------------------------------------ talking to it


def chat(
    base: str,
    prompt: str,
    *,
    key: str,
    max_tokens: int,
    stream: bool = False,
    ignore_eos: bool = False,
    timeout: float = 300,
) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": ignore_eos,
    }
    t0 = time.monotonic()
    try:
        return _chat(base, body, stream, timeout, t0, key)
    except httpx.HTTPError as exc:  # e.g. a stream cut short: an outcome to report, with the logs
        return {"status": -1, "error": repr(exc), "latency_s": time.monotonic() - t0}


def _chat(base: str, body: dict, stream: bool, timeout: float, t0: float, key: str) -> dict:
    with httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {key}"}) as client:
        if not stream:
            r = client.post(f"{base}/v1/chat/completions", json=body)
            if r.status_code != 200:
                return {
                    "status": r.status_code,
                    "error": r.text,
                    "latency_s": time.monotonic() - t0,
                }
            out = r.json()
            choice = out["choices"][0]
            return {
                "status": 200,
                "text": choice["message"]["content"],
                "finish": choice["finish_reason"],
                "tokens": out["usage"]["completion_tokens"],
                "latency_s": time.monotonic() - t0,
            }
        text, finish = [], None
        with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {
                    "status": r.status_code,
                    "error": r.read().decode(),
                    "latency_s": time.monotonic() - t0,
                }
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    return {"status": 500, "error": event, "latency_s": time.monotonic() - t0}
                for c in event["choices"]:
                    text.append(c["delta"].get("content") or "")
                    finish = c.get("finish_reason") or finish
        return {
            "status": 200,
            "text": "".join(text),
            "finish": finish,
            "latency_s": time.monotonic() - t0,
        }


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        (smp.name, tuple(sorted(smp.labels.items()))): smp.value
        for fam in text_string_to_metric_families(text)
        for smp in fam.samples
    }


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def prom_query(stack: Stack, expr: str) -> list[dict]:
    r = httpx.get(f"{stack.url('prometheus')}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


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


def run_workload(stack: Stack, during=None) -> tuple[list[dict], object]:
    """Every prompt on both workers at once (odd ones streamed); `during()`
    runs beside them. The results in (worker, prompt) order, and what
    `during` returned."""
    jobs = [(w, p) for w in WORKERS for p in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs) + 1) as pool:
        futures = [
            pool.submit(
                chat,
                stack.url(w),
                PROMPTS[p],
                key=stack.api_key,
                max_tokens=MAX_TOKENS,
                stream=p % 2 == 1,
                ignore_eos=True,
            )
            for w, p in jobs
        ]
        extra = pool.submit(during) if during else None
        results = [f.result() for f in futures]
        return results, (extra.result() if extra else None)


def generated(stack: Stack) -> float:
    return sum(
        total(scrape(stack.url(w)), "pagedkv_worker_generation_tokens_total") for w in WORKERS
    )


@pytest.fixture(scope="module")
def workload(stack):
    """The workload undisturbed, then again with the allocator restarted in
    the middle; the figures of both."""
    before = {w: scrape(stack.url(w)) for w in WORKERS}
    t0 = time.monotonic()
    reference, _ = run_workload(stack)
    reference_s = time.monotonic() - t0
    mid = {w: scrape(stack.url(w)) for w in WORKERS}

    def restart() -> dict:
        # (counted from before the workload was sent, not from now: it is under way already)
        start = sum(total(mid[w], "pagedkv_worker_generation_tokens_total") for w in WORKERS)
        wait_for(
            lambda: generated(stack) >= start + 16,
            120,
            "the workload to be under way",
            interval_s=0.2,
        )
        t = time.monotonic()
        stack.compose("restart", "allocator", timeout=180)
        restart_s = time.monotonic() - t
        wait_for(
            lambda: stack.health("allocator") == "running/healthy",
            120,
            "the allocator to be healthy again",
            interval_s=1,
        )
        return {
            "restart_s": round(restart_s, 2),
            "restart_to_healthy_s": round(time.monotonic() - t, 2),
        }

    t0 = time.monotonic()
    results, fault = run_workload(stack, during=restart)
    fault_run_s = time.monotonic() - t0
    after = {w: scrape(stack.url(w)) for w in WORKERS}

    def delta(name: str, a: dict, b: dict) -> dict:
        return {w: total(a[w], name) - total(b[w], name) for w in WORKERS}

    figures = {
        "requests": len(results),
        "reference_s": round(reference_s, 1),
        "fault_run_s": round(fault_run_s, 1),
        **fault,
        "preemptions_reference": delta("pagedkv_worker_preemptions_total", mid, before),
        "preemptions_fault_run": delta("pagedkv_worker_preemptions_total", after, mid),
        "allocator_retries": delta("pagedkv_worker_allocator_retries_total", after, mid),
        "stall_s": {
            w: round(v, 2)
            for w, v in delta(
                "pagedkv_worker_allocator_unavailable_seconds_total", after, mid
            ).items()
        },
        "step_errors": delta("pagedkv_worker_step_errors_total", after, mid),
        "max_latency_s": round(max(r["latency_s"] for r in results), 2),
    }
    note("workload", **figures)
    if any(r["status"] != 200 for r in (*reference, *results)):
        for svc in ("allocator", *WORKERS):
            print(f"--- {svc} (last lines)\n{stack.logs(svc)[-6000:]}", flush=True)
    return {"reference": reference, "results": results, "figures": figures}


def test_allocator_restart_mid_workload_completes_every_request_from_the_journal(stack, workload):
    reference, results, figures = workload["reference"], workload["results"], workload["figures"]
    for r in (*reference, *results):
        assert r["status"] == 200, r
        assert r["finish"] == "length", r
    # the same text as without the restart (greedy; recomputing would give it too,
    # but nothing was recomputed: see below)
    assert [r["text"] for r in results] == [r["text"] for r in reference]
    # The pools were small enough to preempt, so the blocks really were contended.
    assert all(n > 0 for n in figures["preemptions_reference"].values()), figures
    assert figures["step_errors"] == {w: 0 for w in WORKERS}, figures

    # The allocator came back from its Redis journal with both pools ...
    log = stack.logs("allocator")
    listening = re.findall(r"pagedkv allocator: listening on .*?(\d+) pools restored\)", log)
    assert len(listening) == 2 and listening[-1] == "2", log[-3000:]
    assert re.search(r"restored 2 pools from redis://redis:6379/0", log), log[-3000:]
    # ... the same ones: no worker lost its pool and recomputed.
    for w in WORKERS:
        assert "was dropped" not in stack.logs(w)
    pools = {
        r["metric"]["pool_id"] for r in prom_query(stack, "pagedkv_allocator_pool_capacity_blocks")
    }
    assert pools == {"worker-1/1", "worker-2/1"}


def test_prometheus_scrapes_utilisation_and_preemption_series_from_every_target(stack, workload):
    allocator, router, workers = "allocator:9400", "router:8000", {f"{w}:8000" for w in WORKERS}

    def series(expr: str) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for r in prom_query(stack, expr):
            out.setdefault(r["metric"]["instance"], []).append(r)
        return out

    seen: dict[str, object] = {}

    def scraped() -> bool:
        seen["up"] = {i: float(rs[0]["value"][1]) for i, rs in series("up").items()}
        seen["preemptions"] = sorted(series("pagedkv_worker_preemptions_total > 0"))
        up = {allocator: 1.0, router: 1.0, **dict.fromkeys(workers, 1.0)}
        return seen["up"] == up and set(seen["preemptions"]) == workers

    t0 = time.monotonic()
    try:
        wait_for(
            scraped,
            60,
            "Prometheus to scrape every target and the workload's preemptions",
            interval_s=1,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen}") from None
    # utilisation: the allocator's per pool, each worker's of its own pool
    util = series("pagedkv_allocator_pool_slot_utilisation_ratio")
    assert set(util) == {allocator}
    assert {r["metric"]["worker_id"] for r in util[allocator]} == set(WORKERS)
    assert set(series("pagedkv_worker_kv_slot_utilisation_ratio")) == workers
    # preemption: each worker counts its own, by cause (above: > 0 on both). The
    # allocator never preempts (the worker plans against its exact count of free
    # blocks and gives blocks back first); its side is the "out of blocks"
    # answers, a series for each pool.
    oob = series("pagedkv_allocator_out_of_blocks_total")
    assert set(oob) == {allocator} and {r["metric"]["worker_id"] for r in oob[allocator]} == set(
        WORKERS
    )
    # the router: the chat test's request through it is counted, by the worker it chose
    routed = series("pagedkv_router_requests_total")
    assert set(routed) == {router} and {r["metric"]["worker"] for r in routed[router]} <= set(
        WORKERS
    )
    note(
        "prometheus",
        targets=sorted([allocator, router, *workers]),
        wait_s=round(time.monotonic() - t0, 1),
    )


def test_down_leaves_no_container_network_or_volume(stack):
    assert any(stack.left_behind().values())  # the labels this test checks are there while it runs
    t0 = time.monotonic()
    stack.compose("down", "-v", "--remove-orphans", timeout=300)
    stack.down = True
    assert stack.left_behind() == {"containers": [], "networks": [], "volumes": []}
    if stack.private_engine:
        # nothing else either: no build container of deploy/local-images.sh, no stray volume
        assert stack.docker("ps", "-aq").stdout.split() == []
        assert stack.docker("volume", "ls", "-q").stdout.split() == []
    note("down", seconds=round(time.monotonic() - t0, 1))
