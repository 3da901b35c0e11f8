"""`pagedkv simulate`: the reference article's capacity figures, to the slot, through
the real command's JSON output."""

from __future__ import annotations

import json
import subprocess
import sys


def simulate(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv", "simulate", "--json", *args],
        capture_output=True,
        text=True,
        check=True,
    )
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


def test_every_request_takes_its_own_blocks_when_all_fit():
    """50 requests fit a pool of 16 GiB: each holds ceil(length / B) blocks of B,
    at every block size, and the lengths are the article's draw."""
    from pagedkv.tools.simulate import MAX_LEN, MIN_LEN, SEED, draw_lengths

    lengths = draw_lengths(50, MIN_LEN, MAX_LEN, SEED)
    # the first 50 of the article's 500
    assert lengths == draw_lengths(500, MIN_LEN, MAX_LEN, SEED)[:50]
    few = simulate("--requests", "50")
    for r in few["sweep"]:
        B = r["block_size"]
        assert r["admitted"] == 50 and r["used_slots"] == sum(lengths)
        assert r["allocated_slots"] == sum(-(-n // B) * B for n in lengths), B
    # a smaller pool, a bigger model, a shorter reservation: fewer fit each way
    base = simulate()
    for flags in (["--pool-gib", "8"], ["--bytes-per-token", "262144"], ["--reserve", "4096"]):
        out = simulate(*flags)
        assert out["contiguous"] != base["contiguous"], flags
