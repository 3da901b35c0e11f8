"""The compose test runs only when asked for: `python -m pytest -m compose`.

It builds images and starts a Docker engine (minutes), so a plain `pytest`
(`make test`) skips it and says how to run it; `-m compose` selects it.

The engine (`docker_host`) and the running stack (`stack`) are session fixtures here so
that test_compose.py and test_compose_workload.py share one stack, brought up once and
taken down by the last test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from pagedkv.stack import free_port
from tests.support.compose import (
    ENGINE,
    HEALTHY_TIMEOUT_S,
    KV_CACHE_MEMORY,
    LOCAL_IMAGES,
    MODEL,
    PROJECT,
    ROOT,
    SERVICES,
    WORKERS,
    Stack,
    note,
)
from tests.support.drills import wait_for


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "compose" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(
        reason="skipped: the compose test runs with `python -m pytest -m compose` "
        "(it builds the images and starts a Docker engine; .ci/run does it)"
    )
    for item in items:
        if item.get_closest_marker("compose") is not None:
            item.add_marker(skip)


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
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
