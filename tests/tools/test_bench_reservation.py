"""`pagedkv bench reservation --workload small` on the simulated GPU: every
system serves every request at each rate it runs, a sweep ends at its first
rate over the bound, the summary and targets are read from the runs, a
reservation never preempts and caps how many requests run at once, and the
plot is written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.bench.reservation import SYSTEMS, TARGETS
from pagedkv.bench.workloads import RESERVATION

SMALL = RESERVATION["small"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    out, png = folder / "reservation.json", folder / "reservation.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "bench",
            "reservation",
            "--workload",
            "small",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "Reservation baselines" in proc.stdout  # the table is printed beside the file
    return json.loads(out.read_text()), png


def test_every_run_serves_every_request_and_sweeps_stop_over_the_bound(run):
    report, _ = run
    bound = report["latency_bound_s"]
    assert bound == SMALL.latency_bound_s and report["kv_bytes_per_token"] == 819_200
    assert list(report["runs"]) == list(SYSTEMS)
    for system, runs in report["runs"].items():
        rates = [r["rate_rps"] for r in runs]
        assert rates == list(SMALL.rates[: len(rates)]), system
        over = [r["normalized_latency_s"] >= bound for r in runs]
        # only the last run may be over the bound, and a sweep that stopped early ended over it
        assert not any(over[:-1]) and (len(runs) == len(SMALL.rates) or over[-1]), system
        for r in runs:
            assert r["requests"] == SMALL.requests, (system, r)
            assert 0 < r["kv_utilisation"] <= 1 and r["normalized_latency_s"] > 0
            assert r["latency_p90_s"] > 0 and r["requests_running_mean"] > 0
        under = [r for r in runs if r["normalized_latency_s"] < bound]
        s = report["summary"][system]
        assert s["max_rate_rps"] == (under[-1]["rate_rps"] if under else None)


def test_the_targets_are_the_ratios_of_the_max_rates(run):
    report, _ = run
    paged = report["summary"]["paged"]["max_rate_rps"]
    for key, target in TARGETS.items():
        other = report["summary"][key.removeprefix("paged_over_")]["max_rate_rps"]
        expected = round(paged / other, 3) if paged is not None and other else None
        assert report["targets"][key] == expected and report["targets"][f"{key}_target"] == target


def test_a_reservation_never_preempts_and_caps_what_runs(run):
    """A reserving request never needs a block past its admission, so never
    preempts anyone; `max` holds the context length (256 slots: 16 of the 64
    blocks, one kept free as headroom), so at most 3 requests run at once.
    Paging runs more at a rate that queues requests."""
    report, _ = run
    for system in ("max", "pow2", "oracle"):
        assert all(r["preemptions"] == 0 for r in report["runs"][system]), system
    assert all(r["requests_running_mean"] <= 3 for r in report["runs"]["max"])
    paged, reserved = report["runs"]["paged"][1], report["runs"]["max"][1]  # 4 requests/s
    assert paged["requests_running_mean"] > reserved["requests_running_mean"]
    assert paged["kv_utilisation"] > reserved["kv_utilisation"]


def test_the_plot_is_a_png(run):
    _, png = run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_fp8_kv_cache_halves_the_kv_bytes_per_token(tmp_path):
    out = tmp_path / "reservation-fp8.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "bench",
            "reservation",
            "--workload",
            "small",
            "--systems",
            "paged",
            "--kv-cache-dtype",
            "fp8",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.read_text())
    assert report["kv_cache_dtype"] == "fp8" and report["kv_bytes_per_token"] == 819_200 // 2
    assert (
        list(report["runs"]) == ["paged"] and report["summary"]["paged"]["max_rate_rps"] is not None
    )
