"""`pagedkv bench attacks --workload small` on real stacks, one with the
credentials `pagedkv up` generates and one without: what a user reads in
its JSON (the figures themselves are never asserted, only what the attacks
achieved and that every figure the table shows is there). The store attacks
get through where the documentation says they do (every pool in one unsealed
namespace, without credentials) and nowhere else."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.bench.attacks.drill import ATTACK_NAMES, STACKS

pytestmark = pytest.mark.slow


def test_bench_attacks_small(tmp_path):
    out_file = tmp_path / "attacks.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "bench",
            "attacks",
            "--workload",
            "small",
            "--json",
            str(out_file),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attacks on a stack with credentials and one without" in proc.stdout
    report = json.loads(out_file.read_text())
    assert report["environment"]["benchmark"] == "attacks"
    assert set(report["stacks"]) == set(STACKS) == {"credentials", "none"}
    for kind, run in report["stacks"].items():
        rows = {r["attack"]: r for r in run["attacks"]}
        assert list(rows) == list(ATTACK_NAMES), kind
        # the victim answered every Step and every request, on both stacks
        assert (
            run["victim"]["errors"] == 0
            and run["victim"]["steps"] > 0
            and run["victim"]["requests"] > 0
        ), run
        for name, r in rows.items():
            assert r["victim_errors"] == 0 and r["exited"] == [], (kind, name, r)
            assert "attack_error" not in r["details"], (kind, name, r["details"])
            for figure in ("allocator_rss_mib_peak", "allocator_threads_peak"):
                assert isinstance(r[figure], int | float) and r[figure] > 0, (kind, name, figure)
            assert r["during"]["steps"] > 0 and r["during"]["requests"] > 0, (kind, name)
        # on either stack the router sent no request to a pool it had not verified
        rogue = rows["rogue-pool"]
        assert rogue["details"]["completions_sent_to_the_attacker"] == 0
        assert rogue["details"]["credentials_sent_to_the_attacker"] == 0
        assert rogue["during"]["answered_by_others"] == 0
        # an evil worker the router proved is bounded on either stack: its answers pass through
        # (whole, or cut where the router's bounds say) without the router holding one whole, and a
        # trickled answer is ended at the router's first-byte timeout
        evil = rows["evil-worker"]
        assert not evil["succeeded"], evil
        passed = evil["details"]["mb_passed_each"]
        assert len(passed) == evil["details"]["answers"] and all(
            0 < mb <= evil["details"]["answer_mb"] for mb in passed
        )
        assert evil["details"]["trickled_whole"]["ended"] == "504 worker_timeout"
        assert evil["details"]["trickled_stream"]["ended"] == "worker_timeout"
    with_credentials = {r["attack"]: r for r in report["stacks"]["credentials"]["attacks"]}
    # with credentials no attack got anywhere: each gRPC one was refused at the door
    assert not any(r["succeeded"] for r in with_credentials.values()), with_credentials
    assert with_credentials["rogue-pool"]["details"]["registered"] == 0
    for name in ("slow-read-flood", "snapshot-amplification", "snapshot-watchers"):
        assert with_credentials[name]["refused"].get("UNAUTHENTICATED", 0) >= 1, name
    without = {r["attack"]: r for r in report["stacks"]["none"]["attacks"]}
    assert without["rogue-pool"]["details"]["registered"] == 4
    assert without["slow-read-flood"]["details"]["pools"] >= 1
    # a worker of another store group, and whoever reads
    # or writes the store's files, got nothing: entries
    # of another group are never found, forged ones are
    # refused as `seal`, sealed ones open to no one else
    poisoning, reading = with_credentials["store-poisoning"], with_credentials["prompt-reading"]
    d = poisoning["details"]
    assert d["entries_planted"] > 0 and d["entries_overwritten"] > 0, d
    assert d["victim_tokens_from_planted"] == d["victim_tokens_from_overwritten"] == 0, d
    assert d["answers_changed_planted"] == d["answers_changed_overwritten"] == 0, d
    assert poisoning["refused"].get("seal", 0) > 0, poisoning["refused"]
    d = reading["details"]
    assert (
        d["entries_read"] > 0 and d["entries_decoded"] == d["decoded_with_its_own_groups_key"] == 0
    ), d
    assert d["tokens_recovered"] == 0 and not d["secret_read_back"], d
    assert reading["refused"] == {"seal": d["entries_read"]}, reading["refused"]
    # without credentials every pool is one trust domain with an unsealed store (the documented
    # development setup): the same attacks poison worker-1's answers and read the tenant's secret
    assert without["store-poisoning"]["succeeded"] and without["prompt-reading"]["succeeded"]
    d = without["store-poisoning"]["details"]
    assert d["victim_tokens_from_planted"] > 0 and d["victim_tokens_from_overwritten"] > 0, d
    assert d["answers_changed_planted"] + d["answers_changed_overwritten"] > 0, d
    d = without["prompt-reading"]["details"]
    assert d["entries_decoded"] > 0 and d["tokens_recovered"] > 0 and d["secret_read_back"], d
    # on either stack a pool's refusals of entries it never loaded leave the index whole: worker-1
    # loads every full block of the prompts worker-2 saved
    for kind in STACKS:
        emptying = {r["attack"]: r for r in report["stacks"][kind]["attacks"]}["store-emptying"]
        d = emptying["details"]
        assert not emptying["succeeded"] and d["hashes_named"] > 0, (kind, d)
        assert d["store_entries_after"] == d["store_entries_before"] > 0, (kind, d)
        assert d["victim_tokens_loaded"] == d["victim_tokens_expected"] > 0, (kind, d)
