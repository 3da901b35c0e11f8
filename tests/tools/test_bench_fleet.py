"""`pagedkv bench fleet`: a recorded Step stream replayed against a fresh
allocator process gets the recording's answers, byte for byte; and the
benchmark reports what it promises (a smoke test: no figure is asserted)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest

from pagedkv.bench.fleet import record
from pagedkv.bench.systems.recording import Recording, replay
from pagedkv.bench.workloads import FLEET


@pytest.fixture(scope="module")
def recording(allocator_server) -> Recording:
    with allocator_server() as server:
        return record(server.address, FLEET["small"].worker)


def test_replayed_answers_equal_the_recording(recording, allocator_server):
    assert recording.steps and 0 < recording.timed_from < len(recording.steps)
    with allocator_server() as server:  # another process: the same answers from fresh pools
        runs, _, _ = asyncio.run(replay([server.address], recording, 3))
    for run in runs:
        assert run.errors == [] and not run.unary
        assert run.calls == len(recording.steps) and run.mismatches == 0
        assert len(run.latencies) == len(recording.steps) - recording.timed_from


def test_a_different_answer_is_a_mismatch(recording, allocator_server):
    last = recording.steps[-1]
    tampered = Recording(
        recording.shape,
        [*recording.steps[:-1], dataclasses.replace(last, response=b"")],
        recording.timed_from,
    )
    with allocator_server() as server:
        (run,), _, _ = asyncio.run(replay([server.address], tampered, 1))
    assert run.errors == [] and run.mismatches == 1


def test_bench_fleet_json():
    w = FLEET["small"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "bench",
            "fleet",
            "--json",
            "--workload",
            "small",
            "--allocators",
            "1,2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = json.loads(proc.stdout)
    assert set(out["summary"]) == {str(n) for n in w.workers}
    for by_allocators in out["summary"].values():
        assert set(by_allocators) == {"1", "2"}
        for case in by_allocators.values():
            assert case["errors"] == 0 and case["step_p50_ms"] > 0 and case["allocator_rss_mib"] > 0
    assert set(out["targets"]["knee_workers"]) == {"1", "2"}
    assert out["memory"]["blocks"] == w.memory_blocks and out["memory"]["bytes_per_block_full"] > 0
    floor = out["call_floor"]
    assert floor["calls"] == w.floor_calls
    assert all(floor[k] > 0 for k in ("in_process_us", "stream_us", "unary_us"))
    assert out["profile"] is None
