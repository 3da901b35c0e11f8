"""`pagedkv bench route` runs every policy and the reference on real
processes, with CPU-bound processes beside them when asked, and reports
what it promises, the hit rate's spread over rounds included (a smoke test:
the figures themselves are never asserted, only that every request was
answered and every key is there and agrees with the runs)."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys

from pagedkv.bench.route import ASKING, POLICIES, REFERENCE, background_load
from pagedkv.bench.workloads import ROUTE


def test_bench_route_json():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "bench",
            "route",
            "--json",
            "--workload",
            "small",
            "--background-load",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = json.loads(proc.stdout)
    assert set(out["summary"]) == {*POLICIES, ASKING, REFERENCE}
    small = ROUTE["small"]
    assert (
        out["workload"]["background_load"] == 1 and out["workload"]["rounds"] == small.rounds == 2
    )
    assert (out["workload"]["tenants"], out["workload"]["prompt_tokens"]) == (
        small.tenants,
        small.prompt_tokens,
    )
    for name, s in out["summary"].items():
        assert s["errors"] == 0, name
        assert 0 <= s["hit_rate"] <= 1 and s["tokens_per_s"] > 0 and s["ttft_p50_ms"] > 0
        assert 0.5 <= s["busiest_worker_share"] <= 1
        rounds = s["hit_rate_per_round"]
        assert rounds == [r["hit_rate"] for r in out["runs"][name]] and len(rounds) == 2
        assert s["hit_rate_min"] == min(rounds) <= s["hit_rate"] <= max(rounds) == s["hit_rate_max"]
    assert set(out["targets"]) == {
        "kv_hit_rate_of_one_worker_with_both_pools",
        "kv_tokens_per_s_over_round_robin",
        "kv_ttft_p50_of_round_robin",
        "router_added_p50_ms",
        "kv_hit_rate_of_one_worker_with_both_pools_worst_round",
        "kv_tokens_per_s_over_round_robin_worst_round",
        "kv_tokens_per_s_over_round_robin_bound",
    }
    summary = out["summary"]
    assert out["targets"]["kv_tokens_per_s_over_round_robin_bound"] == round(
        (1 - summary["round-robin"]["hit_rate"])
        / (1 - summary["one-worker-2x-memory"]["hit_rate"]),
        3,
    )
    per_round = out["per_round"]["kv_hit_rate_of_one_worker_with_both_pools"]
    assert len(per_round) == 2 and out["targets"][
        "kv_hit_rate_of_one_worker_with_both_pools_worst_round"
    ] == min(per_round)
    probe = out["probe"]
    assert probe["requests_each"] == small.probe_requests
    for key in (
        "direct_p50_ms",
        "routed_p50_ms",
        "short_prompt_direct_p50_ms",
        "short_prompt_routed_p50_ms",
        "match_prefix_routed_p50_ms",
        "short_prompt_match_prefix_routed_p50_ms",
    ):
        assert probe[key] > 0, key
    assert out["targets"]["router_added_p50_ms"] == probe["added_p50_ms"]


def test_the_background_load_spins_while_inside_and_is_gone_after():
    before = set(multiprocessing.active_children())
    with background_load(2):
        spinning = [p for p in multiprocessing.active_children() if p not in before]
        assert len(spinning) == 2 and all(p.is_alive() for p in spinning)
    assert not any(p.is_alive() for p in spinning)


def test_a_negative_background_load_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv", "bench", "route", "--background-load", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--background-load" in proc.stderr
