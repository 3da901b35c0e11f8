"""`pagedkv bench allocator` runs all three modes and reports what it
promises (a smoke test: the figures themselves are never asserted)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pagedkv.bench.workloads import STEPS


def test_bench_allocator_json():
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv", "bench", "allocator", "--json", "--workload", "small"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(proc.stdout)
    cases = {(r["mode"], r["seqs"]) for r in out["results"]}
    assert cases == {(m, n) for m in ("in-process", "grpc", "grpc+redis") for n in (1, 8)}
    for r in out["results"]:
        assert (
            0 < r["p50_ms"] <= r["p99_ms"]
            and r["ops_per_s"] > 0
            and r["steps"] == STEPS["small"].steps
        )
    assert set(out["redis_overhead_p50"]) == {"1", "8"}


def test_bench_allocator_with_an_event_follower():
    """--watch-events: the gRPC case again with another process following
    every event; packed, it got the step's block events in fewer messages."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "bench",
            "allocator",
            "--json",
            "--workload",
            "small",
            "--modes",
            "grpc",
            "--watch-events",
            "none,plain,packed",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = {r["watcher"]: r for r in json.loads(proc.stdout)["results"] if r["seqs"] == 8}
    assert set(rows) == {"none", "plain", "packed"} and "watcher_events" not in rows["none"]
    assert rows["plain"]["watcher_events"] == rows["plain"]["watcher_messages"] > 0
    assert rows["packed"]["watcher_events"] > rows["packed"]["watcher_messages"] > 0
    bad = subprocess.run(
        [sys.executable, "-m", "pagedkv", "bench", "allocator", "--watch-events", "some"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--watch-events" in bad.stderr


@pytest.mark.parametrize("separate", [False, True])
def test_noisy_neighbour_reports_both_phases(separate):
    """Both phases run against one real allocator (with --separate-neighbour
    the neighbour has its own); the neighbour really sent every kind of heavy
    request and each was answered (a prebuilt request with a wrong step id or
    credential would be refused)."""
    small = STEPS["small"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "bench",
            "allocator",
            "--noisy-neighbour",
            "--json",
            "--workload",
            "small",
            *(["--separate-neighbour"] if separate else []),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    out = json.loads(proc.stdout)
    assert (out["victim_seqs"], out["neighbour_blocks"]) == (
        small.victim_seqs,
        small.neighbour_blocks,
    )
    for phase in ("quiet", "noisy"):
        assert (
            out[phase]["steps"] == small.steps and 0 < out[phase]["p50_ms"] <= out[phase]["p99_ms"]
        )
        # the allocator's own timing of the victim's steps, read from its /metrics
        assert 0 < out[phase]["server_p50_le_ms"] <= out[phase]["server_p99_le_ms"]
    assert out["p99_ratio"] == out["noisy"]["p99_ms"] / out["quiet"]["p99_ms"]
    assert out["neighbour_allocator"] == ("own" if separate else "shared")
    assert out["neighbour_client"] == "prebuilt"
    assert set(out["neighbour_requests"]) == {
        "admit",
        "fork x8",
        "integrity check",
        "dump",
        "match prefix",
        "free",
    }
