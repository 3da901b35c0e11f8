"""`pagedkv bench compare --baseline DIR BENCHMARK [ARGS]`: one benchmark run
by two checkouts of PagedKV in turn, on the same machine in one sitting, and
each headline figure of one set against the other's.

DIR is another checkout (a `git worktree` of an older commit, say) with its
own `make install` done: its `.venv/bin/python` runs its own code. Each of
`--rounds` rounds runs `pagedkv bench BENCHMARK ARGS --json` in DIR and
in this checkout, the first of the pair alternating from round to round, so
neither always runs on a machine the other has just warmed or loaded.

The figures are the benchmark's own headline figures (its module's
`figures(report)`: name -> value, and whether lower is better), read from the
two checkouts' reports by this checkout's code. A figure is "better" or
"worse" (by its direction) only when the ranges of its values over the
rounds are apart by more than the wider of the two ranges: a difference
larger than what either checkout's code showed from round to round.
Otherwise it is "within noise". (Two checkouts whose figures come from one
distribution get a verdict by chance for under 1% of figures at 3 rounds,
about 0.1% at 4; ranges merely apart would give 10% at 3.) Not a timed
assertion: the verdicts describe one run on one machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from pagedkv.bench import BENCHMARKS, harness
from pagedkv.bench.harness import Table, cell

#: the benchmarks whose module says what their headline figures are
COMPARABLE = ("allocator", "core", "route")
THIS = Path(__file__).resolve().parents[2]  # the checkout this code runs from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline",
        required=True,
        metavar="DIR",
        help="the other checkout (with its .venv from `make install`) to run the benchmark in",
    )
    parser.add_argument(
        "--rounds",
        type=_rounds,
        default=3,
        help="rounds; each runs the benchmark once in each checkout, at least 2 [3]",
    )
    harness.add_json_option(parser)
    parser.add_argument("benchmark", choices=COMPARABLE, help="the benchmark both checkouts run")
    parser.add_argument(
        "arguments",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="its arguments, given to both (no --json: each run's report is collected)",
    )


def _rounds(text: str) -> int:
    n = harness.positive(text)
    if n < 2:
        raise argparse.ArgumentTypeError(
            "at least 2 rounds: noise is read from the spread over rounds"
        )
    return n


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv_base.settings import CliError

    baseline = Path(args.baseline).expanduser().resolve()
    python = baseline / ".venv" / "bin" / "python"
    if not python.is_file():
        raise CliError(
            f"--baseline {args.baseline}: no {python} (run `make install` in that checkout)"
        )
    if baseline == THIS:
        raise CliError(f"--baseline {args.baseline} is this checkout")
    if any(a == "--json" or a.startswith("--json=") for a in args.arguments):
        raise CliError(
            "give --json to `bench compare`, not to the benchmark: each run's report is collected"
        )
    sides = {"baseline": (python, baseline), "this": (Path(sys.executable), THIS)}
    reports: dict[str, list[dict]] = {"baseline": [], "this": []}
    for rnd in range(args.rounds):
        for side in ("baseline", "this") if rnd % 2 == 0 else ("this", "baseline"):
            exe, root = sides[side]
            # `--json` alone prints the report on stdout, in every version of the benchmarks
            command = [
                str(exe),
                "-m",
                "pagedkv",
                "bench",
                args.benchmark,
                *args.arguments,
                "--json",
            ]
            harness.log("compare", f"round {rnd + 1}/{args.rounds}: {side} ({root})")
            done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise CliError(
                    f"{side} ({root}): `{' '.join(command[1:])}` exited {done.returncode}: "
                    f"{done.stderr.strip()[-2000:]}"
                )
            try:
                reports[side].append(json.loads(done.stdout))
            except ValueError:
                raise CliError(
                    f"{side} ({root}): `{' '.join(command[1:])}` printed no JSON report: "
                    f"{done.stdout.strip()[:500]!r}"
                ) from None
    figures = importlib.import_module(BENCHMARKS[args.benchmark][0]).figures
    values: dict[str, dict[str, list[float | None]]] = {}
    lower: dict[str, bool] = {}
    for side, side_reports in reports.items():
        for report in side_reports:
            for name, (value, lower_is_better) in figures(report).items():
                values.setdefault(name, {"baseline": [], "this": []})[side].append(value)
                lower.setdefault(name, lower_is_better)
    return {
        "benchmark": args.benchmark,
        "arguments": args.arguments,
        "rounds": args.rounds,
        "baseline": _checkout(baseline),
        "this": _checkout(THIS),
        "figures": [
            _figure(name, v["baseline"], v["this"], lower[name]) for name, v in values.items()
        ],
        "runs": {
            side: [r.get("environment") for r in side_reports]
            for side, side_reports in reports.items()
        },
    }


def _figure(
    name: str, base: list[float | None], this: list[float | None], lower_is_better: bool
) -> dict:
    """One figure's values from both checkouts, their medians' ratio and the verdict."""
    b = [v for v in base if v is not None]
    t = [v for v in this if v is not None]
    verdict = None
    if b and t:
        spread = max(max(b) - min(b), max(t) - min(t))
        if min(b) - max(t) > spread:
            verdict = "better" if lower_is_better else "worse"
        elif min(t) - max(b) > spread:
            verdict = "worse" if lower_is_better else "better"
        else:
            verdict = "within noise"
    return {
        "figure": name,
        "lower_is_better": lower_is_better,
        "baseline": base,
        "this": this,
        "ratio": harness.ratio(statistics.median(t), statistics.median(b)) if b and t else None,
        "verdict": verdict,
    }


def _checkout(root: Path) -> dict[str, Any]:
    """Where a checkout is and which commit it holds (None outside git)."""

    def git(*words: str) -> str | None:
        done = subprocess.run(
            ["git", "-C", str(root), *words], capture_output=True, text=True, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "path": str(root),
        "commit": git("rev-parse", "--short=12", "HEAD"),
        "subject": git("log", "-1", "--format=%s"),
        "modified": None if status is None else bool(status),
    }


def tables(report: dict) -> list[Table]:
    def checkout(c: dict) -> str:
        return f"{c['commit'] or c['path']}" + (" (modified)" if c.get("modified") else "")

    rows = []
    for f in report["figures"]:
        b = [v for v in f["baseline"] if v is not None]
        t = [v for v in f["this"] if v is not None]
        rows.append(
            [
                f["figure"],
                "lower" if f["lower_is_better"] else "higher",
                cell(statistics.median(b) if b else None),
                cell(statistics.median(t) if t else None),
                cell(f["ratio"]),
                f"{cell(min(b))}-{cell(max(b))}" if b else "-",
                f"{cell(min(t))}-{cell(max(t))}" if t else "-",
                f["verdict"] or "-",
            ]
        )
    verdicts = [f["verdict"] for f in report["figures"]]
    notes = [
        f"baseline {checkout(report['baseline'])}: {report['baseline']['subject']}",
        f"this {checkout(report['this'])}: {report['this']['subject']}",
        f"{verdicts.count('within noise')} of {len(verdicts)} figures within noise, "
        f"{verdicts.count('better')} better, {verdicts.count('worse')} worse"
        + "".join(
            f"; worse: {f['figure']} ({cell(f['ratio'])}x)"
            for f in report["figures"]
            if f["verdict"] == "worse"
        ),
    ]
    args = " ".join(report["arguments"])
    return [
        Table(
            title=f"pagedkv bench {report['benchmark']}{' ' + args if args else ''}: this checkout "
            f"against the baseline, {report['rounds']} "
            "interleaved rounds (median; range over the rounds)",
            columns=[
                "figure",
                "better",
                "baseline",
                "this",
                "this / baseline",
                "baseline range",
                "this range",
                "verdict",
            ],
            rows=rows,
            notes=notes
            + [
                "a verdict other than within noise: the ranges are apart by more than the "
                "wider of the two"
            ],
        )
    ]


def run(args: argparse.Namespace) -> int:
    return harness.run("compare", args, measure, tables)
