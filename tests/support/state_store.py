"""The allocator's state store as the log-integrity tests reach it
(tests/allocator/test_log_integrity.py, test_log_redis.py; their private redis-server is
the `store` fixture of tests/allocator/conftest.py): its raw client, and the allocator's
`--check` and a start expected to fail, each run as a process."""

from __future__ import annotations

import os
import subprocess
import sys

import redis as redis_lib

from allocator_service.store.journal import split_prefix

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def keys(url: str):
    base, prefix = split_prefix(url)
    return redis_lib.Redis.from_url(base), prefix


def run_check(url: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    p = subprocess.run(
        [sys.executable, "-m", "allocator_service", "--state", url, "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert "Traceback" not in p.stdout + p.stderr
    return p.returncode, p.stdout + p.stderr


def start_fails(url: str, env: dict[str, str] | None = None, *extra: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "allocator_service",
            "--listen",
            "127.0.0.1:0",
            "--state",
            url,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert "Traceback" not in p.stdout + p.stderr
    return p.returncode, p.stdout + p.stderr
