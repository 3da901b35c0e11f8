"""What the deployment-file tests share (tests/stack/test_deploy.py, test_deploy_k8s.py,
test_deploy_pd.py): the repository's deploy/ folder, the compose services, a container
command's flags, and the manifests `kubectl kustomize` renders."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
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


def kustomize(folder: Path) -> list[dict]:
    """The manifests `kubectl kustomize FOLDER` renders (skips without kubectl)."""
    exe = need("kubectl", "kubernetes-client")
    proc = subprocess.run(
        [exe, "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _one(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc
