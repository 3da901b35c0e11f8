"""`pagedkv bench allocator` runs all three modes and reports what it
promises (a smoke test: the figures themselves are never asserted)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def test_bench_allocator_json():
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv", "bench", "allocator", "--json", "--sizes", "1,8",
         "--steps", "20", "--warmup", "2"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    out = json.loads(proc.stdout)
    cases = {(r["mode"], r["seqs"]) for r in out["results"]}
    assert cases == {(m, n) for m in ("in-process", "grpc", "grpc+redis") for n in (1, 8)}
    for r in out["results"]:
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["ops_per_s"] > 0 and r["steps"] == 20
    assert set(out["redis_overhead_p50"]) == {"1", "8"}
