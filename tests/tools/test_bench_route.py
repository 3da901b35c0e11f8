"""`pagedkv bench route` runs every policy and the reference on real
processes and reports what it promises (a smoke test: the figures
themselves are never asserted, only that every request was answered and
every key is there)."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedkv.bench.route import ASKING, POLICIES, REFERENCE


def test_bench_route_json():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv", "bench", "route", "--json", "--prompts", "2", "--prompt-tokens", "40",
         "--conversations", "2", "--max-tokens", "2", "--rounds", "1", "--probe-requests", "3"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    out = json.loads(proc.stdout)
    assert set(out["summary"]) == {*POLICIES, ASKING, REFERENCE}
    for name, s in out["summary"].items():
        assert s["errors"] == 0, name
        assert 0 <= s["hit_rate"] <= 1 and s["tokens_per_s"] > 0 and s["ttft_p50_ms"] > 0
        assert 0.5 <= s["busiest_worker_share"] <= 1
    assert set(out["targets"]) == {"kv_hit_rate_of_one_worker_with_both_pools", "kv_tokens_per_s_over_round_robin",
                                   "kv_ttft_p50_of_round_robin", "router_added_p50_ms"}
    probe = out["probe"]
    assert probe["requests_each"] == 3
    for key in ("direct_p50_ms", "routed_p50_ms", "short_prompt_direct_p50_ms", "short_prompt_routed_p50_ms",
                "match_prefix_routed_p50_ms", "short_prompt_match_prefix_routed_p50_ms"):
        assert probe[key] > 0, key
    assert out["targets"]["router_added_p50_ms"] == probe["added_p50_ms"]
