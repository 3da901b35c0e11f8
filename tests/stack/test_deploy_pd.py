"""The prefill/decode variants of the deployment files: deploy/compose.pd.yaml over
docker-compose.yml, and the kustomize overlay deploy/k8s-pd, checked offline as
tests/stack/test_deploy.py and test_deploy_k8s.py check the others (docker-compose config,
kubectl kustomize, kubernetes-validate; each skips, saying so, without its tool)."""

from __future__ import annotations

import argparse
import subprocess

import pytest
import yaml

from tests.support.deploy import (
    DEPLOY,
    ROOT,
    SERVICES,
    _one,
    flags,
    kustomize,
    need,
    with_defaults,
)
from worker.cli import WorkerArgs
from worker.cli import add_arguments as worker_arguments

OVERRIDE = DEPLOY / "compose.pd.yaml"


def _role(env: dict[str, str]) -> str:
    """The --kv-role a worker started with this environment takes (its own CLI reads it)."""
    from pagedkv_base.config import from_args

    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        parser = argparse.ArgumentParser()
        worker_arguments(parser)
        return from_args(WorkerArgs, parser.parse_args([])).kv_role


def _merged_compose() -> dict:
    """docker-compose.yml with the override laid over it, as compose merges a service's
    environment (by key; the rest of the service is the base's)."""
    base = yaml.safe_load(with_defaults((ROOT / "docker-compose.yml").read_text()))
    for name, service in yaml.safe_load(OVERRIDE.read_text())["services"].items():
        assert set(service) == {"environment"}, name  # only the role changes
        target = base["services"][name]  # a fresh mapping: the anchor's is shared
        target["environment"] = {**target["environment"], **service["environment"]}
    return base


def test_compose_override_makes_worker_1_prefill_and_worker_2_decode():
    s = _merged_compose()["services"]
    roles = {name: _role(s[name]["environment"]) for name in ("worker-1", "worker-2")}
    assert roles == {"worker-1": "prefill", "worker-2": "decode"}
    # the blocks move through the allocator's shared store, which both workers mount
    allocator = flags(s["allocator"]["command"])
    assert allocator["--kv-shared-store"] == "file:///kv-store"
    for name in ("worker-1", "worker-2"):
        assert "kv-store:/kv-store" in s[name]["volumes"]
        assert "--no-kv-shared-store" not in s[name]["command"]
        assert "--enable-prefix-caching" in s[name]["command"]


def test_docker_compose_config_validates_with_the_pd_override():
    exe = need("docker-compose", "docker-compose")
    proc = subprocess.run(
        [exe, "-f", str(ROOT / "docker-compose.yml"), "-f", str(OVERRIDE), "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    assert set(services) == SERVICES
    assert services["worker-1"]["environment"]["PAGEDKV_WORKER_KV_ROLE"] == "prefill"
    assert services["worker-2"]["environment"]["PAGEDKV_WORKER_KV_ROLE"] == "decode"


@pytest.fixture(scope="module")
def k8s_pd() -> list[dict]:
    return kustomize(DEPLOY / "k8s-pd")


def test_k8s_overlay_runs_one_prefill_and_one_decode_worker(k8s_pd):
    [settings] = [d for d in k8s_pd if d["kind"] == "ConfigMap"]
    assert settings["data"]["PAGEDKV_ALLOCATOR_KV_SHARED_STORE"] == "redis://kv-store:6379/0"
    workers = {
        d["metadata"]["name"]: d
        for d in k8s_pd
        if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("worker")
    }
    assert set(workers) == {"worker", "worker-prefill"}
    roles, selectors = {}, []
    for name, deployment in workers.items():
        assert deployment["spec"]["replicas"] == 1
        assert deployment["metadata"]["namespace"] == "pagedkv"
        assert deployment["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pagedkv"
        pod = deployment["spec"]["template"]
        [c] = pod["spec"]["containers"]
        assert c["image"] == "pagedkv:cuda" and c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["envFrom"][0]["configMapRef"]["name"] == settings["metadata"]["name"]
        env = {e["name"]: e.get("value") for e in c["env"] if "value" in e}
        roles[name] = _role({**settings["data"], **env})
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        selectors.append(selector)
        assert flags(c["args"])["--device"] == "cuda"
    assert roles == {"worker": "decode", "worker-prefill": "prefill"}
    assert selectors[0] != selectors[1]  # each Deployment owns its own pods
    # the rest is the base's: one Service for the workers, the allocator, the router, the stores
    names = {(d["kind"], d["metadata"]["name"]) for d in k8s_pd}
    assert ("Service", "worker") in names and ("Service", "worker-prefill") not in names
    for kind, name in (
        ("Deployment", "allocator"),
        ("Deployment", "router"),
        ("Deployment", "kv-store"),
    ):
        assert _one(k8s_pd, kind, name)


def test_k8s_overlay_matches_the_api_schemas(k8s_pd):
    kv = pytest.importorskip(
        "kubernetes_validate", reason="skipped: `kubernetes-validate` (PyPI) not installed"
    )
    for doc in k8s_pd:
        kv.validate(doc, "1.32.0", strict=True)
