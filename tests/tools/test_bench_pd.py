"""`pagedkv bench pd`: the report's shape and sane values on the small simulated
configuration (12 requests on sim:h100), on real CPU workers (tiny-random, the first
CPU_REQUESTS requests of the cpu workload) and in a rate sweep; the figures themselves are
compared only within a run (docs/benchmarks.md), never here."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from pagedkv.bench.pd import SYSTEMS
from pagedkv.bench.report import render
from pagedkv.bench.workloads import PD

# The three systems take the stream one after the other, each on fresh real workers: the cpu
# workload's first three requests (two of them documents at its seed) show the split, the bytes
# moved and the identical ids as its six do.
CPU_REQUESTS = 3


def _bench(tmp_path_factory, workload: str, *more: str) -> tuple[dict, str]:
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
            *more,
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
    return _bench(tmp_path_factory, "cpu", "--requests", str(CPU_REQUESTS))


def _split_by_role(name: str, s: dict, requests: int) -> None:
    """A pd system's figures: every request's prompt computed by worker-1 (prefill), its
    answer streamed by worker-2 (decode), which loaded the prompt's blocks."""
    assert s["split_requests"] == requests and s["transfers"]["prefill_failed"] == 0, name
    assert s["prefill_workers"] == ["worker-1"] and s["answering_workers"] == ["worker-2"]
    assert [w["role"] for w in s["workers"].values()] == ["prefill", "decode"], name
    assert s["transfer_s_per_request"] >= 0 and s["prefill_leg_s_per_request"] > 0
    assert s["cached_tokens_per_request"] > 0, name
    assert s["bytes_saved_per_request"] > 0 and s["bytes_loaded_per_request"] > 0, name


def _answered_by_every_system(report: dict, w) -> None:
    assert list(report["summary"]) == list(SYSTEMS) == ["colocated", "pd", "pd-peer"]
    assert report["stream"]["requests"] == w.requests
    for name, s in report["summary"].items():
        assert s["requests"] == w.requests and s["errors"] == 0, (name, s["first_error"])
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"], name
        # tokens read in one chunk are stamped microseconds apart: a p50 of 0.00 ms on a busy
        # machine is what the client saw
        assert 0 <= s["itl_p50_ms"] <= s["itl_p99_ms"] and s["itl_p99_ms"] > 0, name
        assert s["tokens_per_s"] > 0 and s["slo_met"] <= s["requests"]
        assert s["goodput_rps"] == pytest.approx(s["slo_met"] / s["wall_s"], abs=1e-3)
        # a request meets both bounds, or misses at least one of them
        assert max(s["ttft_missed"], s["tpot_missed"]) <= s["requests"] - s["slo_met"]
        assert s["requests"] - s["slo_met"] <= s["ttft_missed"] + s["tpot_missed"]
        # each worker's device computed while it had requests, never more than the run
        assert list(s["workers"]) == ["worker-1", "worker-2"], name
        for worker in s["workers"].values():
            assert 0 <= worker["device_busy"] <= 1.05, (name, worker)
            assert 0 <= worker["allocator_wait"] <= 1, (name, worker)
            if worker["requests"]:
                assert worker["device_busy"] > 0 and worker["queue_s_per_request"] >= 0
                assert worker["prefill_s_per_request"] > 0, (name, worker)
    co = report["summary"]["colocated"]
    # colocated: whole requests on two `both` workers, nothing moves between them
    assert co["split_requests"] == 0 and co["prefill_workers"] == []
    assert co["transfer_s_per_request"] is None
    assert {w["role"] for w in co["workers"].values()} == {"both"}
    assert sum(w["requests"] for w in co["workers"].values()) == w.requests
    for name in ("pd", "pd-peer"):
        _split_by_role(name, report["summary"][name], w.requests)
    t = report["targets"]
    for against in (t, t["pd-peer"]):  # pd's at the top level, as the issue names them
        assert against["outputs_compared"] == w.requests and against["outputs_identical"] is True
        for key in ("itl_p99_ratio", "goodput_ratio"):
            assert against[key] > 0 and isinstance(against[f"{key}_met"], bool)


def test_simulated_pair_colocated_and_split(sim):
    report, stdout = sim
    _answered_by_every_system(report, PD["small"])
    assert report["device"] == "sim:h100" and report["kv_bytes_per_token"] == 131_072
    for name in ("pd", "pd-peer"):
        # the decode worker found the prompt's blocks in the store, by either path
        s = report["summary"][name]
        loaded = s["cached_tokens_per_request"] * report["kv_bytes_per_token"]
        assert s["bytes_loaded_per_request"] == pytest.approx(loaded, abs=0.1 * 131_072)
    demand = report["stream"]["prefill_device_s_per_request"]
    assert demand["compute_s"] > 0 and demand["saves_s"] > 0
    assert "P/D targets" in stdout  # the tables are printed beside the JSON
    page = render([("pd.json", report)])
    assert "## pd" in page and "ITL p99, pd / colocated" in page
    assert "ITL p99, pd-peer / colocated" in page and "where the time goes" in page


def test_real_cpu_workers_answer_the_same_split_or_not(cpu):
    report, _ = cpu
    _answered_by_every_system(report, replace(PD["cpu"], requests=CPU_REQUESTS))
    assert report["device"] == "cpu" and report["model"] == "tiny-random"
    # real bytes: what the prefill worker saved, the decode worker loaded, through the file
    # store and straight from the prefill worker's memory alike
    for name in ("pd", "pd-peer"):
        by_worker = report["summary"][name]["bytes_by_worker"]
        assert by_worker["worker-2"]["loaded:shared"] > 0, name
    assert report["stream"]["prefill_device_s_per_request"] is None  # a roofline is sim's


def test_rate_sweep_reports_goodput_per_rate_and_capacity(tmp_path_factory):
    # 6 requests a rate keep the stream at 8 requests/s long enough for the goodput check's 1e-3
    # tolerance (wall_s is rounded to the millisecond); two rates, the lower one at 4 requests/s
    report, stdout = _bench(tmp_path_factory, "small", "--rates", "8,4", "--requests", "6")
    assert "summary" not in report and "targets" not in report
    sw = report["sweep"]
    assert sw["rates"] == [4.0, 8.0] and sw["requests_per_rate"] == 6  # lowest first
    assert list(sw["systems"]) == list(SYSTEMS)
    for name, points in sw["systems"].items():
        assert [p["rate_rps"] for p in points] == sw["rates"]
        for p in points:
            assert p["requests"] == 6 and p["errors"] == 0, (name, p["first_error"])
            assert p["slo_attainment"] == pytest.approx(p["slo_met"] / 6, abs=1e-4)
            assert p["goodput_rps"] == pytest.approx(p["slo_met"] / p["wall_s"], rel=1e-3)
            # the same requests at each rate on every system: the same greedy ids
            assert p["outputs_differing"] == (None if name == "colocated" else 0)
            if name != "colocated":
                _split_by_role(name, p, 6)
        met = [p["rate_rps"] for p in points if p["slo_attainment"] >= sw["attainment"]]
        assert sw["capacity_rps"][name] == (max(met) if met else None)
    assert report["stream"]["rate_rps"] is None and report["stream"]["streams"] == 2
    assert "P/D rate sweep" in stdout
    assert "Capacity" in render([("pd-sweep.json", report)])
