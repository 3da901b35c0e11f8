"""`pagedkv bench pd`: the report's shape and sane values on the small simulated
configuration (12 requests on sim:h100) and on real CPU workers (tiny-random); the
figures themselves are compared only within a run (docs/benchmarks.md), never here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.bench.pd import SYSTEMS
from pagedkv.bench.report import render
from pagedkv.bench.workloads import PD


def _bench(tmp_path_factory, workload: str) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / f"pd-{workload}.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "bench",
            "pd",
            "--workload",
            workload,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=True,
    )
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    return _bench(tmp_path_factory, "small")


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    return _bench(tmp_path_factory, "cpu")


def _answered_by_both_systems(report: dict, w) -> None:
    assert list(report["summary"]) == list(SYSTEMS)
    assert report["stream"]["requests"] == w.requests
    for name, s in report["summary"].items():
        assert s["requests"] == w.requests and s["errors"] == 0, (name, s["first_error"])
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"], name
        assert 0 < s["itl_p50_ms"] <= s["itl_p99_ms"], name
        assert s["tokens_per_s"] > 0 and s["slo_met"] <= s["requests"]
        assert s["goodput_rps"] == pytest.approx(s["slo_met"] / s["wall_s"], abs=1e-3)
    co, pd = report["summary"]["colocated"], report["summary"]["pd"]
    # colocated: whole requests on two `both` workers, nothing moves between them
    assert co["split_requests"] == 0 and co["prefill_workers"] == []
    assert co["transfer_s_per_request"] is None
    # pd: every request's prompt computed by worker-1, its answer streamed by worker-2
    assert pd["split_requests"] == w.requests and pd["transfers"]["prefill_failed"] == 0
    assert pd["prefill_workers"] == ["worker-1"] and pd["answering_workers"] == ["worker-2"]
    assert pd["transfer_s_per_request"] >= 0 and pd["prefill_leg_s_per_request"] > 0
    assert pd["cached_tokens_per_request"] > 0
    assert pd["bytes_saved_per_request"] > 0 and pd["bytes_loaded_per_request"] > 0
    t = report["targets"]
    assert t["outputs_compared"] == w.requests and t["outputs_identical"] is True
    for key in ("itl_p99_ratio", "goodput_ratio"):
        assert t[key] > 0 and isinstance(t[f"{key}_met"], bool)


def test_simulated_pair_colocated_and_split(sim):
    report, stdout = sim
    _answered_by_both_systems(report, PD["small"])
    assert report["device"] == "sim:h100" and report["kv_bytes_per_token"] == 131_072
    pd = report["summary"]["pd"]
    # what the decode worker loaded is what it found cached: the prompt's whole blocks
    loaded = pd["cached_tokens_per_request"] * report["kv_bytes_per_token"]
    assert pd["bytes_loaded_per_request"] == pytest.approx(loaded, abs=0.1 * 131_072)
    assert "P/D targets" in stdout  # the tables are printed beside the JSON
    page = render([("pd.json", report)])
    assert "## pd" in page and "ITL p99, pd / colocated" in page


def test_real_cpu_workers_answer_the_same_split_or_not(cpu):
    report, _ = cpu
    _answered_by_both_systems(report, PD["cpu"])
    assert report["device"] == "cpu" and report["model"] == "tiny-random"
