"""`pagedkv bench kv-dtype --workload small` on tiny-random: every figure is
reported for auto and each fp8 format, auto agrees with itself, and fp8 pools
hold four times the float32 blocks of the same memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.bench.workloads import KV_DTYPE


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "kv_dtype.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "bench",
            "kv-dtype",
            "--workload",
            "small",
            "--kv-cache-dtype",
            "fp8,fp8_e5m2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert "mean |dlogprob|" in proc.stdout  # the table is printed beside the file
    return json.loads(out.read_text())


def test_every_dtype_reports_every_figure(report):
    small = KV_DTYPE["small"]
    assert report["model"] == "tiny-random" and list(report["results"]) == [
        "auto",
        "fp8",
        "fp8_e5m2",
    ]
    auto = report["results"]["auto"]
    assert auto["logprob_diff_mean_nats"] == auto["logprob_diff_max_nats"] == 0.0
    assert auto["greedy_identical"] == {str(n): 1.0 for n in small.tokens}
    for kv in ("fp8", "fp8_e5m2"):
        r = report["results"][kv]
        assert 0 <= r["logprob_diff_mean_nats"] <= r["logprob_diff_max_nats"] < 5
        assert set(r["greedy_identical"]) == {str(n) for n in small.tokens}
        assert 0 <= r["multiple_choice_accuracy"] <= 1
        assert r["kv_pool_blocks"] == 4 * auto["kv_pool_blocks"]  # float32 on the CPU
