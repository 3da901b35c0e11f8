"""The benchmark harness as a user meets it: `--json FILE` records the command,
machine and date of a run beside its figures; a figure not measured is "-"
in a table; `pagedkv bench report` renders the committed results, and the
committed docs/benchmarks.md is exactly what it renders."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.bench import harness, report
from pagedkv.bench.harness import Table, cell

ROOT = Path(__file__).resolve().parents[2]


def pagedkv(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=cwd,
    )


def test_committed_page_is_what_the_committed_results_render():
    results = report.load(ROOT / "docs" / "benchmarks")
    assert {r["environment"]["benchmark"] for _, r in results} >= {"core", "allocator"}
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == report.render(results), "run: pagedkv bench report --write docs/benchmarks.md"


def test_every_committed_result_names_a_command_that_runs_today():
    """The command beside each committed figure is one today's `pagedkv` accepts."""
    from pagedkv.cli import build_parser

    parser = build_parser()
    for file, result in report.load(ROOT / "docs" / "benchmarks"):
        words = shlex.split(result["environment"]["command"])
        assert words[:3] == ["pagedkv", "bench", result["environment"]["benchmark"]], file
        parser.parse_args(words[1:])  # SystemExit (a usage error) fails the test


def test_json_file_records_the_run_and_the_report_renders_it(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    proc = pagedkv("bench", "core", "--workload", "small", "--json", str(out / "core.json"))
    assert "allocator core, 200 sequences" in proc.stdout  # the table is printed beside the file
    recorded = json.loads((out / "core.json").read_text())
    env = recorded["environment"]
    assert env["command"] == f"pagedkv bench core --workload small --json {out / 'core.json'}"
    assert env["machine"]["cpu_cores"] >= 1 and env["machine"]["cpu_model"]
    assert env["date"].endswith("Z") and env["load_average_1m_start"] >= 0
    page = pagedkv("bench", "report", str(out)).stdout
    assert env["command"] in page and f"{env['machine']['cpu_cores']} cores" in page
    assert env["date"][:10] in page and "| on |" in page and "| off |" in page


def test_a_figure_not_measured_is_a_dash_never_zero():
    table = Table(
        "t",
        ["system", "peak", "share"],
        [["a", cell(None), cell(None, ".1%")], ["b", cell(0), cell(0.5, ".1%")]],
    )
    assert "| a | - | - |" in harness.markdown(table) and "| b | 0 | 50.0% |" in harness.markdown(
        table
    )


@settings(max_examples=30, deadline=None)
@given(
    workload=st.sampled_from(["default", "small"]),
    repeats=st.integers(1, 9),
    allocators=st.lists(
        st.sampled_from(["embedded", "grpc", "grpc+redis"]), min_size=1, max_size=3, unique=True
    ),
    compare=st.booleans(),
    json_to=st.sampled_from([None, "-", "out dir/x.json"]),
)
def test_recorded_command_parses_back_to_the_same_options(
    workload, repeats, allocators, compare, json_to
):
    """The command a report records runs the benchmark with the options it ran with."""
    from pagedkv.cli import build_parser

    argv = [
        "bench",
        "serve",
        "--workload",
        workload,
        "--repeats",
        str(repeats),
        "--allocator",
        ",".join(allocators),
        *(["--compare-async-scheduling"] if compare else []),
    ]
    argv += [] if json_to is None else ["--json"] if json_to == "-" else ["--json", json_to]
    parser = build_parser()
    args = parser.parse_args(argv)
    words = shlex.split(harness.command_line("serve", args))
    assert words[0] == "pagedkv"
    again = parser.parse_args(words[1:])
    assert {k: v for k, v in vars(again).items() if k != "_bench_parser"} == {
        k: v for k, v in vars(args).items() if k != "_bench_parser"
    }
