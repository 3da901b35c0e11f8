"""`pagedkv up`: real processes on free ports, health, failure reports, clean shutdown."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pagedkv.stack import (
    LocalStack,
    Process,
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
FREE_PORTS = {"PAGEDKV_UP_BASE_PORT": "0", "PAGEDKV_UP_ALLOCATOR_PORT": "0", "PAGEDKV_UP_ALLOCATOR_METRICS_PORT": "0"}


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
    assert worker_cli.worker_args(worker.parse_args(handed)) == worker_cli.worker_args(worker.parse_args(given))
    # nothing given, nothing handed on: each worker's own defaults and PAGEDKV_WORKER_* decide;
    # no --threads: the stack gives each worker 1/N of the cores (tests/stack/test_e2e.py)
    assert worker_args_from(p.parse_args([])) == []
    assert to_argv(RouterArgs, p.parse_args(["--policy", "least-load"])) == ["--policy", "least-load"]
    with pytest.raises(SystemExit):
        p.parse_args(["--num-blocks", "many"])
    # the workers' other settings are not flags of `pagedkv up`: their variables reach them
    # (test_up_starts_the_topology_and_stops_it_on_sigint)
    for flag in ("--threads", "--block-size", "--max-model-len"):
        with pytest.raises(SystemExit):
            p.parse_args([flag, "4"])
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "up", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: pagedkv up" in proc.stdout


def test_generated_prometheus_config_passes_promtool(tmp_path):
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("skipped: no `promtool` on PATH (Debian package `prometheus`; .ci/run installs it)")
    path = tmp_path / "prometheus.yml"
    path.write_text(prometheus_config(["127.0.0.1:9400"], ["127.0.0.1:8001", "127.0.0.1:8002"], "1s"))
    proc = subprocess.run([exe, "check", "config", str(path)], capture_output=True, text=True, timeout=30)
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
    ready = tmp_path / "ready.json"
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 - closed below
    # --block-size is not a flag of `pagedkv up`: each worker reads its own variable
    env = {**os.environ, **FREE_PORTS, "PAGEDKV_UP_GRACE": "10", "PAGEDKV_WORKER_BLOCK_SIZE": "4",
           "PAGEDKV_WORKER_MAX_MODEL_LEN": "96"}
    up = subprocess.Popen(
        [sys.executable, "-m", "pagedkv", "up", "--workers", "2", *TINY[:4], "--router-port", "0",
         "--ready-file", str(ready)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        assert len(info["workers"]) == 2 and len(set(info["workers"])) == 2
        for url in info["workers"]:
            assert http_ok(f"{url}/health")
            # the settings given as the workers' variables reached them
            card = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=5).read())["data"][0]
            assert card["max_model_len"] == 96
        assert grpc_health_ok(info["allocator"])
        # both workers registered their pools with the one allocator
        metrics = urllib.request.urlopen(info["allocator_metrics"], timeout=5).read().decode()
        assert "pagedkv_allocator_pools 2.0" in metrics
        assert {"allocator", "worker-1", "worker-2", "router"} == set(info["pids"])
        # the router is the front door: it found both workers through the allocator
        import httpx

        assert httpx.get(f"{info['router']}/health", timeout=5).json()["workers"] == 2
        assert all(url.startswith("http://127.0.0.1:") for url in info["workers"])  # internal
        family = _descendants(up.pid)
        assert set(info["pids"].values()) <= family
        log_dir = Path(info["log_dir"])
        assert (log_dir / "worker-1.log").exists()

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        log.close()
    out = (tmp_path / "up.log").read_text()
    assert "all healthy" in out and "worker-2 |" in out and "all processes stopped" in out
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in family if _alive(pid)] == []
    assert not log_dir.exists()  # the temporary log folder is removed


def test_up_reports_the_worker_that_failed(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv", "up", "--workers", "1", "--model", str(tmp_path / "no-such-model"),
         "--router-port", "0"],
        capture_output=True, text=True, timeout=90, env={**os.environ, **FREE_PORTS, "PAGEDKV_UP_TIMEOUT": "60"},
    )
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    assert "pagedkv up: error: worker-1 exited with status" in out and "no-such-model" in out
    kept = Path(out.rsplit("logs kept in ", 1)[1].split()[0])
    assert "no-such-model" in (kept / "worker-1.log").read_text()
    shutil.rmtree(kept)


def test_local_stack_with_redis_and_prometheus(tmp_path):
    with LocalStack(workers=1, model="tiny-random", worker_args=TINY[2:], redis=True, prometheus=True,
                    scrape_interval="1s", log_dir=tmp_path / "logs") as stack:
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
                targets = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["activeTargets"]
                health = {t["labels"]["job"]: t["health"] for t in targets}
                if health == {"pagedkv-allocator": "up", "pagedkv-worker": "up"} or time.monotonic() > deadline:
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
