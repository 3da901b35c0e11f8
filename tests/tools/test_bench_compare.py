"""`pagedkv bench compare` as a user meets it: two checkouts run one benchmark
in turn, and a baseline made slower is told apart from this checkout; the
verdict reads the rounds' ranges, and a chance one is rare."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pagedkv", "pagedkv_base", "allocator_service", "worker", "router")
SLOWER = "time.sleep(0.004)  # the baseline's planted slowdown\n        results = client.step(ops)"


def pagedkv(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=check,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def slower_baseline(tmp_path_factory) -> Path:
    """A copy of this checkout whose allocator bench takes 4 ms more inside every timed Step."""
    base = tmp_path_factory.mktemp("baseline")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, base / name, ignore=shutil.ignore_patterns("__pycache__"))
    bench = base / "pagedkv" / "bench" / "allocator.py"
    text = bench.read_text(encoding="utf-8")
    assert text.count("results = client.step(ops)") == 1
    bench.write_text(text.replace("results = client.step(ops)", SLOWER), encoding="utf-8")
    (base / ".venv").symlink_to(sys.prefix)  # this venv: the copy's code comes first on its path
    return base


def test_this_checkout_is_better_than_a_baseline_made_slower(slower_baseline, tmp_path):
    out = tmp_path / "compare.json"
    pagedkv(
        "bench",
        "compare",
        "--baseline",
        str(slower_baseline),
        "--rounds",
        "2",
        "--json",
        str(out),
        "allocator",
        "--workload",
        "small",
        "--modes",
        "in-process",
    )
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["environment"]["command"] == (
        f"pagedkv bench compare --baseline {slower_baseline} --rounds 2 --json {out} "
        "allocator --workload small --modes in-process"
    )
    assert report["baseline"]["path"] == str(slower_baseline.resolve())
    assert report["baseline"]["commit"] is None  # not a git checkout
    figures = {f["figure"]: f for f in report["figures"]}
    assert set(figures) == {
        f"in-process {n} seqs Step {q} ms" for n in (1, 8) for q in ("p50", "p99")
    }
    for f in figures.values():
        assert len(f["baseline"]) == len(f["this"]) == 2 and f["lower_is_better"]
    # every baseline Step took 4 ms more; in-process steps take microseconds here
    p50 = figures["in-process 8 seqs Step p50 ms"]
    assert min(p50["baseline"]) >= 4.0 and max(p50["this"]) < 4.0
    assert p50["verdict"] == "better" and p50["ratio"] < 0.5
    assert len(report["runs"]["baseline"]) == len(report["runs"]["this"]) == 2


def test_the_verdict_reads_the_ranges_of_the_rounds():
    from pagedkv.bench.compare import _figure

    assert _figure("x", [1.0, 1.2], [1.1, 1.3], True)["verdict"] == "within noise"
    # apart, but by less than a range is wide: within noise
    assert _figure("x", [1.0, 1.2], [1.3, 1.4], True)["verdict"] == "within noise"
    assert _figure("x", [1.0, 1.2], [1.5, 1.6], True)["verdict"] == "worse"
    assert _figure("x", [1.0, 1.2], [1.5, 1.6], False)["verdict"] == "better"
    assert _figure("x", [1.0, 1.2], [0.5, 0.7], True) | {"baseline": 0} == {
        "figure": "x",
        "lower_is_better": True,
        "baseline": 0,
        "this": [0.5, 0.7],
        "ratio": 0.545,
        "verdict": "better",
    }
    unmeasured = _figure("x", [None, None], [1.0, 1.0], True)
    assert unmeasured["verdict"] is None and unmeasured["ratio"] is None


def test_bad_baselines_and_arguments_get_one_clear_line(tmp_path):
    done = pagedkv("bench", "compare", "--baseline", str(tmp_path), "allocator", check=False)
    assert done.returncode == 2 and f"no {tmp_path}/.venv/bin/python" in done.stderr
    done = pagedkv("bench", "compare", "--baseline", str(ROOT), "allocator", check=False)
    assert done.returncode == 2 and "is this checkout" in done.stderr
    done = pagedkv("bench", "compare", "--baseline", "x", "--rounds", "1", "allocator", check=False)
    assert done.returncode == 2 and "at least 2 rounds" in done.stderr
    (tmp_path / ".venv").symlink_to(sys.prefix)
    done = pagedkv(
        "bench",
        "compare",
        "--baseline",
        str(tmp_path),
        "allocator",
        "--json",
        "x.json",
        check=False,
    )
    assert done.returncode == 2 and "give --json to `bench compare`" in done.stderr


def test_a_verdict_by_chance_is_rare():
    """Two checkouts whose figures come from one distribution: at 3 rounds
    under 1.5% of figures get a verdict other than within noise."""
    import random

    from pagedkv.bench.compare import _figure

    rng = random.Random(7)
    trials = 20_000
    verdicts = [
        _figure(
            "x", [rng.gauss(10, 1) for _ in range(3)], [rng.gauss(10, 1) for _ in range(3)], True
        )["verdict"]
        for _ in range(trials)
    ]
    assert verdicts.count("within noise") / trials > 0.985
