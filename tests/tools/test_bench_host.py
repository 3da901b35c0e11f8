"""`pagedkv bench host` runs both allocators at each size and reports what it
promises (a smoke test: the figures themselves are never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedkv.bench.host import PARTS
from pagedkv.bench.workloads import HOST


def test_bench_host_json():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv", "bench", "host", "--json", "--workload", "small"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = json.loads(proc.stdout)
    assert out["device"] == "sim:h100" and out["roofline"]["gpu"] == "NVIDIA H100 SXM5 80GB"
    assert set(out["summary"]) == {
        f"{a}/{n}" for a in ("embedded", "grpc") for n in HOST["small"].sizes
    }
    for case in out["summary"].values():
        assert 0 < case["device_busy_ratio"] <= 1
        assert case["tpot_p50_ms"] >= case["device_ms_per_step"] * 0.5 > 0
        assert set(case["host_ms_per_step"]) == set(PARTS) and all(
            v >= 0 for v in case["host_ms_per_step"].values()
        )
    # 256 sequences over gRPC is not in the small workload:
    # the target's figure is not measured, so null
    assert out["targets"]["device_busy_ratio_grpc_256"] is None and out["targets"]["met"] is None


def test_bench_host_refuses_a_real_device():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "bench",
            "host",
            "--workload",
            "small",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "sim:NAME" in proc.stderr
