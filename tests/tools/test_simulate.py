"""`pagedkv simulate`: the reference article's capacity figures, to the slot, through
the real command's JSON output."""

from __future__ import annotations

import json
import subprocess
import sys


def simulate(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "simulate", "--json", *args],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_default_is_the_articles_figures():
    out = simulate()
    c, p = out["contiguous"], out["paged"]
    assert out["pool_slots"] == 131_072  # 16 GiB / 128 KiB
    assert c["admitted"] == 16
    assert c["reserved_slots"] == 131_072
    assert f"{c['used_fraction']:.1%}" == "12.9%"
    assert p["block_size"] == 16
    assert p["admitted"] == 122
    assert p["allocated_slots"] == 130_800  # 8,175 blocks of 16
    assert p["wasted_slots"] == 913
    assert f"{p['wasted_slots'] / p['allocated_slots']:.1%}" == "0.7%"
    assert f"{out['ratio_admitted']:.1f}" == "7.6"
    # The default sweep is every block size 1..16, all on the same draw.
    assert [r["block_size"] for r in out["sweep"]] == list(range(1, 17))
    assert out["sweep"][-1] == p
    assert out["sweep"][0]["wasted_slots"] == 0
    assert {r["used_slots"] for r in out["sweep"]} == {p["used_slots"]}


def test_workload_flags_still_change_the_draw():
    base = simulate("--block-sizes", "16")
    for flags in (["--seed", "1"], ["--requests", "50"], ["--min-len", "500"], ["--max-len", "1000"]):
        out = simulate("--block-sizes", "16", *flags)
        assert out["paged"] != base["paged"], flags
    few = simulate("--block-sizes", "16", "--requests", "50", "--min-len", "100", "--max-len", "100")
    assert few["paged"]["admitted"] == 50 and few["paged"]["used_slots"] == 5_000
    assert few["paged"]["allocated_slots"] == 50 * 112  # 7 blocks of 16 per 100-token request


def test_block_size_outside_the_sweep_is_still_reported():
    out = simulate("--block-sizes", "1,4", "--block-size", "32")
    assert [r["block_size"] for r in out["sweep"]] == [1, 4]
    assert out["paged"]["block_size"] == 32
