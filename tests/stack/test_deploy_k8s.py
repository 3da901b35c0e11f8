"""Deployment files: the kustomize manifests of deploy/k8s (the compose, Docker,
Prometheus and Grafana files: tests/stack/test_deploy.py).

No cluster runs here: the manifests are rendered with `kubectl kustomize` (the test says
when kubectl is missing and skips), checked structurally, against the settings the CLIs
read, and against the Kubernetes API schemas (`kubernetes-validate`, skipped without it).
"""

from __future__ import annotations

import argparse

import pytest

from tests.support.deploy import DEPLOY, _one, flags, kustomize


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
