"""`pagedkv up`: real processes on free ports, health, failure reports, clean shutdown."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from pagedkv.stack import (
    LocalStack,
    Process,
    Service,
    StackError,
    grpc_health_ok,
    http_ok,
    prometheus_config,
    redis_ping_ok,
    stop_processes,
    wait_healthy,
)
from pagedkv.up import add_parser, worker_args_from
from pagedkv_base.config import to_argv
from router.cli import RouterArgs
from worker import cli as worker_cli

TINY = ["--model", "tiny-random", "--num-blocks", "32", "--block-size", "4"]
# `pagedkv up` on free ports: its settings that are variables only
FREE_PORTS = {
    "PAGEDKV_UP_BASE_PORT": "0",
    "PAGEDKV_UP_ALLOCATOR_PORT": "0",
    "PAGEDKV_UP_ALLOCATOR_METRICS_PORT": "0",
}


def _parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser()
    return add_parser(root.add_subparsers())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@contextlib.contextmanager
def _up(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen, dict]]:
    """`pagedkv up ARGS` on free ports with a ready file, `env` added to its environment:
    (its process, the ready file's addresses and pids); its output in tmp_path/up.log;
    killed at the end if still running."""
    ready = tmp_path / "ready.json"
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 - closed below
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "up",
            *args,
            "--router-port",
            "0",
            "--ready-file",
            str(ready),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **FREE_PORTS, **(env or {})},
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.2)
        yield up, json.loads(ready.read_text())
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        log.close()


def test_every_flag_has_help_and_passes_through():
    p = _parser()
    assert [a.dest for a in p._actions if not a.help] == []
    given = ["--device", "cpu", "--num-blocks", "64"]
    args = p.parse_args(given)
    handed = worker_args_from(args)
    assert handed == ["--num-blocks", "64", "--device", "cpu"]
    # what a worker makes of them is what `pagedkv worker` makes of the same flags
    worker = argparse.ArgumentParser()
    worker_cli.add_arguments(worker)
    assert worker_cli.worker_args(worker.parse_args(handed)) == worker_cli.worker_args(
        worker.parse_args(given)
    )
    # nothing given, nothing handed on: each worker's own defaults and PAGEDKV_WORKER_* decide;
    # no --threads: the stack gives each worker 1/N of the cores (tests/stack/test_e2e.py)
    assert worker_args_from(p.parse_args([])) == []
    assert to_argv(RouterArgs, p.parse_args(["--policy", "least-load"])) == [
        "--policy",
        "least-load",
    ]
    with pytest.raises(SystemExit):
        p.parse_args(["--num-blocks", "many"])
    # the workers' other settings are not flags of `pagedkv up`: their variables reach them
    # (test_up_starts_the_topology_and_stops_it_on_sigint)
    for flag in ("--threads", "--block-size", "--max-model-len"):
        with pytest.raises(SystemExit):
            p.parse_args([flag, "4"])
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv", "up", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "usage: pagedkv up" in proc.stdout


def test_generated_prometheus_config_passes_promtool(tmp_path):
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip(
            "skipped: no `promtool` on PATH (Debian package `prometheus`; .ci/run installs it)"
        )
    path = tmp_path / "prometheus.yml"
    path.write_text(
        prometheus_config(["127.0.0.1:9400"], ["127.0.0.1:8001", "127.0.0.1:8002"], "1s")
    )
    proc = subprocess.run(
        [exe, "check", "config", str(path)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_process_that_dies_is_named_with_its_last_lines(tmp_path):
    script = "print('loading the model'); print('boom: no such model'); raise SystemExit(3)"
    proc = Process("worker-7", [sys.executable, "-c", script], tmp_path / "w.log", "cyan")
    with pytest.raises(StackError) as err:
        wait_healthy([(proc, lambda: False)], timeout=30)
    msg = str(err.value)
    assert msg.startswith("worker-7 exited with status 3") and "boom: no such model" in msg
    stop_processes([[proc]], grace=1)
    assert "boom" in (tmp_path / "w.log").read_text()


def test_unhealthy_timeout_then_sigkill_reaches_grandchildren(tmp_path):
    # A process that ignores SIGTERM and leaves a grandchild that does too.
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "print('grandchild', child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = Process("stubborn", [sys.executable, "-c", script], tmp_path / "s.log", "cyan")
    with pytest.raises(StackError, match=r"stubborn was not healthy after 1 s"):
        wait_healthy([(proc, lambda: False)], timeout=1)
    grandchild = int(next(line for line in proc.tail if line.startswith("grandchild")).split()[1])
    t0 = time.monotonic()
    stop_processes([[proc]], grace=0.5)
    assert time.monotonic() - t0 < 5
    assert not proc.alive()
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_killed_launcher_leaves_no_orphans(tmp_path):
    """SIGKILL gives the launcher no chance to clean up: its children still die with it."""
    launcher = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from pagedkv.stack import Process\n"
        f"p = Process('sleeper', ['sleep', '600'], Path({str(tmp_path / 's.log')!r}), 'cyan')\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    deadline = time.monotonic() + 10
    while "sleep" not in Path(f"/proc/{child}/cmdline").read_text():  # exec'd past the wrapper
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_up_starts_the_topology_and_stops_it_on_sigint(tmp_path):
    # --block-size is not a flag of `pagedkv up`: each worker reads its own variable
    with _up(
        tmp_path,
        "--workers",
        "2",
        *TINY[:4],
        env={
            "PAGEDKV_UP_GRACE": "10",
            "PAGEDKV_WORKER_BLOCK_SIZE": "4",
            "PAGEDKV_WORKER_MAX_MODEL_LEN": "96",
        },
    ) as (up, info):
        assert len(info["workers"]) == 2 and len(set(info["workers"])) == 2
        # an API key by default, in the file the ready file (and the console) names
        key = Path(info["api_keys_file"]).read_text().strip()
        auth = {"Authorization": f"Bearer {key}"}
        for url in info["workers"]:
            assert http_ok(f"{url}/health")
            # the settings given as the workers' variables reached them
            request = urllib.request.Request(f"{url}/v1/models", headers=auth)
            card = json.loads(urllib.request.urlopen(request, timeout=5).read())["data"][0]
            assert card["max_model_len"] == 96
        assert grpc_health_ok(info["allocator"])
        # both workers registered their pools with the one allocator
        metrics = urllib.request.urlopen(info["allocator_metrics"], timeout=5).read().decode()
        assert "pagedkv_allocator_pools 2.0" in metrics
        assert {"allocator", "worker-1", "worker-2", "router"} == set(info["pids"])
        # the router is the front door: it found both workers through the allocator
        import httpx

        assert httpx.get(f"{info['router']}/health", timeout=5).json()["workers"] == 2
        # no key, no answer: at the router and at each worker
        body = {"model": "tiny-random", "prompt": "Hello", "max_tokens": 3}
        for url in (info["router"], *info["workers"]):
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 401, r.text
        # with it, the openai client is served
        client = openai.OpenAI(base_url=f"{info['router']}/v1", api_key=key, max_retries=0)
        answer = client.completions.create(**body)
        assert answer.usage.completion_tokens == 3
        assert "API key: " + info["api_keys_file"] in (tmp_path / "up.log").read_text()
        assert all(url.startswith("http://127.0.0.1:") for url in info["workers"])  # internal
        family = _descendants(up.pid)
        assert set(info["pids"].values()) <= family
        log_dir = Path(info["log_dir"])
        assert (log_dir / "worker-1.log").exists()

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
    out = (tmp_path / "up.log").read_text()
    assert "all healthy" in out and "worker-2 |" in out and "all processes stopped" in out
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in family if _alive(pid)] == []
    assert not log_dir.exists()  # the temporary log folder is removed


def test_up_reports_the_worker_that_failed(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "up",
            "--workers",
            "1",
            "--model",
            str(tmp_path / "no-such-model"),
            "--router-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, **FREE_PORTS, "PAGEDKV_UP_TIMEOUT": "60"},
    )
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    assert "pagedkv up: error: worker-1 exited with status" in out and "no-such-model" in out
    kept = Path(out.rsplit("logs kept in ", 1)[1].split()[0])
    assert "no-such-model" in (kept / "worker-1.log").read_text()
    shutil.rmtree(kept)


def test_local_stack_with_redis_and_prometheus(tmp_path):
    with LocalStack(
        workers=1,
        model="tiny-random",
        worker_args=TINY[2:],
        redis=True,
        prometheus=True,
        scrape_interval="1s",
        log_dir=tmp_path / "logs",
    ) as stack:
        assert stack.worker_urls and http_ok(f"{stack.worker_urls[0]}/health")
        pids = [p.pid for p in stack.processes.values()]
        if stack.redis_url is None:
            assert any("redis-server" in w for w in stack.warnings)
        else:
            host, port = stack.redis_url.removeprefix("redis://").rsplit("/", 1)[0].split(":")
            assert redis_ping_ok(host, int(port))
            assert (tmp_path / "logs" / "redis").is_dir()  # its append-only file lives there
        if stack.prometheus_url is None:
            assert any("prometheus" in w for w in stack.warnings)
        else:
            deadline = time.monotonic() + 20
            while True:
                url = f"{stack.prometheus_url}/api/v1/targets"
                targets = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"][
                    "activeTargets"
                ]
                health = {t["labels"]["job"]: t["health"] for t in targets}
                if (
                    health == {"pagedkv-allocator": "up", "pagedkv-worker": "up"}
                    or time.monotonic() > deadline
                ):
                    break
                time.sleep(0.5)
            assert health == {"pagedkv-allocator": "up", "pagedkv-worker": "up"}
        assert stack.logs("worker-1") and stack.logs("allocator")  # output is kept per process
    assert stack.processes == {}
    assert not any(_alive(pid) for pid in pids)
    assert (tmp_path / "logs" / "allocator.log").exists()  # a given log folder is kept


def test_local_stack_refuses_a_busy_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(StackError, match=f"port {busy} for the allocator is already in use"):
            LocalStack(workers=1, allocator_port=busy).start()


def _stream(
    url: str, key: str, prompt: str, started: threading.Event, killed: threading.Event
) -> tuple[list[str], int]:
    """(the `data:` payloads of a streamed completion through `url`, as they came;
    how many came after `killed` was set)."""
    import httpx

    events, after = [], 0
    body = {
        "model": "tiny-random",
        "prompt": prompt,
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                after += killed.is_set()
                started.set()
    return events, after


def test_up_restarts_a_killed_allocator_and_no_stream_is_cut(tmp_path):
    """kill -9 of the allocator while streams pass through the router: `pagedkv up`
    restarts it (one line says so), its workers register new pools with the empty
    allocator (memory state) and finish every stream; the stack answers afterwards."""
    import httpx

    log_path = tmp_path / "up.log"
    with _up(
        tmp_path,
        "--workers",
        "2",
        "--model",
        "tiny-random",
        "--num-blocks",
        "256",
        "--log-dir",
        str(tmp_path / "logs"),
        env={"PAGEDKV_WORKER_BLOCK_SIZE": "4"},
    ) as (up, info):
        router = info["router"]
        key = Path(info["api_keys_file"]).read_text().strip()
        starts, killed = [threading.Event() for _ in range(4)], threading.Event()
        with ThreadPoolExecutor(4) as pool:
            streams = [
                pool.submit(
                    _stream,
                    router,
                    key,
                    f"Stream {i} says: " + "tell me more. " * 4,
                    started,
                    killed,
                )
                for i, started in enumerate(starts)
            ]
            for started in starts:
                assert started.wait(120), log_path.read_text()
            os.kill(info["pids"]["allocator"], signal.SIGKILL)
            killed.set()
            results = [s.result(timeout=300) for s in streams]
        for events, after_kill in results:
            # it was in flight: the kill fell in the middle
            assert events[-1] == "[DONE]" and after_kill > 1
            chunks = [json.loads(e) for e in events[:-1]]
            assert [c for c in chunks if "error" in c] == []
            assert [
                c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]
            ] == ["length"]
        assert up.poll() is None, log_path.read_text()
        # The stack answers afterwards: once the restarted
        # allocator lists the new pools and the router proved them.
        deadline = time.monotonic() + 120
        while True:
            r = httpx.post(
                f"{router}/v1/completions",
                timeout=60,
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "tiny-random", "prompt": "After the restart", "max_tokens": 4},
            )
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200, (r.text, log_path.read_text())
        assert httpx.get(f"{router}/health", timeout=5).json()["workers"] == 2
        out = log_path.read_text()
        assert out.count("allocator exited (SIGKILL); restarting it") == 1, out
        assert "---- start 2" in (tmp_path / "logs" / "allocator.log").read_text()
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0


def test_a_process_that_keeps_exiting_fast_is_given_up_on(monkeypatch):
    import pagedkv.stack.services as services

    monkeypatch.setattr(services, "RESTART_DELAYS", (0.0, 0.1))

    class Crashing(Service):
        def argv(self) -> list[str]:
            return [sys.executable, "-c", "print('boom: no such model'); raise SystemExit(3)"]

    stack = LocalStack(workers=1, model="tiny-random")
    stack.services["worker-1"] = Crashing("worker-1").start()
    with pytest.raises(StackError) as err:
        stack.supervise()
    assert str(err.value).startswith(
        f"worker-1 exited (status 3) {services.GIVE_UP_AFTER} "
        "times in a row within 30 s of starting; given up on"
    )
    assert "boom: no such model" in str(err.value)
    # one line per restart before it: the first GIVE_UP_AFTER - 1 exits
    assert stack.restarts == [
        f"worker-1 exited (status 3); restarting it in {0.0 if n == 1 else 0.1:g} s "
        f"(restart {n}, {n} fast exits in a row)"
        for n in range(1, services.GIVE_UP_AFTER)
    ]
    stack.stop()
