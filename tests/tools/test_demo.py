"""`pagedkv demo`, the main job, end to end on the tiny model: the real stack
(allocator + two worker processes + the router), the chat workload through
the router's HTTP API, the report with its routing figures and the
chart (the same code path as `make demo`, seconds not a minute)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_runs_the_workload_and_writes_its_report(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "demo",
            "--model",
            "tiny-random",
            "--conversations",
            "8",
            "--out",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])  # --json: the report is the last line
    saved = json.loads((tmp_path / "demo_report.json").read_text())
    assert report["requests"] == saved["requests"] >= 8
    assert report["errors"] == 0, report["error_samples"]
    # the workers' high-water marks (every engine step), not what a 0.25 s poll happened to see
    assert (
        report["completion_tokens"] > 0
        and 0 < report["peak_slots_holding_tokens"] <= report["peak_slots_allocated"]
    )
    assert 1 <= report["peak_running_conversations"] <= 8  # at most the 8 conversations
    assert report["prefix_cache_hit_rate"] > 0  # every conversation shares the system prompt
    assert (tmp_path / "demo_kv.png").stat().st_size > 0
    routing = report["routing"]
    assert (
        routing["policy"] == "kv"
        and sum(routing["requests_per_worker"].values()) == report["requests"]
    )
    # the shared system prompt was found cached where
    # requests were sent (never more than the best had)
    assert (
        0
        < routing["prefix_tokens_cached_where_sent"]
        <= routing["prefix_tokens_cached_best_worker"]
    )
    assert routing["retries"] == 0 and routing["routing_ms_mean"] > 0
