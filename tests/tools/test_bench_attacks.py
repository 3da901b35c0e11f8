"""`pagedkv bench attacks --workload small` on real stacks, one with the
credentials `pagedkv up` generates and one without: what a user reads in
its JSON (the figures themselves are never asserted, only what the attacks
achieved and that every figure the table shows is there)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.bench.attacks import ATTACK_NAMES, STACKS

pytestmark = pytest.mark.slow


def test_bench_attacks_small(tmp_path):
    out_file = tmp_path / "attacks.json"
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "bench", "attacks", "--workload", "small",
                           "--json", str(out_file)], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attacks on a stack with credentials and one without" in proc.stdout
    report = json.loads(out_file.read_text())
    assert report["environment"]["benchmark"] == "attacks"
    assert set(report["stacks"]) == set(STACKS) == {"credentials", "none"}
    for kind, run in report["stacks"].items():
        rows = {r["attack"]: r for r in run["attacks"]}
        assert list(rows) == list(ATTACK_NAMES), kind
        # the victim answered every Step and every request, on both stacks
        assert run["victim"]["errors"] == 0 and run["victim"]["steps"] > 0 and run["victim"]["requests"] > 0, run
        for name, r in rows.items():
            assert r["victim_errors"] == 0 and r["exited"] == [], (kind, name, r)
            for figure in ("allocator_rss_mib_peak", "allocator_threads_peak"):
                assert isinstance(r[figure], int | float) and r[figure] > 0, (kind, name, figure)
            assert r["during"]["steps"] > 0 and r["during"]["requests"] > 0, (kind, name)
        # on either stack the router sent no request to a pool it had not verified
        rogue = rows["rogue-pool"]
        assert rogue["details"]["completions_sent_to_the_attacker"] == 0
        assert rogue["details"]["credentials_sent_to_the_attacker"] == 0
        assert rogue["during"]["answered_by_others"] == 0
    with_credentials = {r["attack"]: r for r in report["stacks"]["credentials"]["attacks"]}
    # with credentials no attack got anywhere: each gRPC one was refused at the door
    assert not any(r["succeeded"] for r in with_credentials.values()), with_credentials
    assert with_credentials["rogue-pool"]["details"]["registered"] == 0
    for name in ("slow-read-flood", "snapshot-amplification", "snapshot-watchers"):
        assert with_credentials[name]["refused"].get("UNAUTHENTICATED", 0) >= 1, name
    without = {r["attack"]: r for r in report["stacks"]["none"]["attacks"]}
    assert without["rogue-pool"]["details"]["registered"] == 4
    assert without["slow-read-flood"]["details"]["pools"] >= 1
