"""What every benchmark shares: the `--workload` and `--json` options, the record
of where and when a run happened, its tables, and the small statistics they all use.

A benchmark module provides `add_arguments(parser)`, `measure(args) -> dict`
(the report: what `--json` writes) and `tables(report) -> list[Table]`. The
tables are built from the report alone, so the terminal and
`docs/benchmarks.md` (`pagedkv bench report`) show the same thing. A figure
not measured is `None` in the report (`null` in JSON) and "-" in a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from allocator_service.core import native

STDOUT = "-"


@dataclass(frozen=True)
class Table:
    """A titled grid of already formatted cells, with lines of notes under it."""

    title: str
    columns: Sequence[str]
    rows: Sequence[Sequence[str]]
    notes: Sequence[str] = field(default_factory=tuple)


def cell(value: Any, spec: str = "") -> str:
    """`value` formatted with `spec`; "-" for a figure not measured (None)."""
    if value is None:
        return "-"
    if isinstance(value, list):
        return " ".join(cell(v, spec) for v in value)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and not spec:
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return format(value, spec)


def verdict(met: bool | None) -> str:
    """A target's outcome in a table: met, not met, or not measured (None)."""
    return "not measured" if met is None else "met" if met else "not met"


# -- running one benchmark --------------------------------------------------------------


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        nargs="?",
        const=STDOUT,
        default=None,
        metavar="FILE",
        help="write the report as one JSON object: to FILE (the table is still printed), or with "
        "no FILE to stdout instead of the table",
    )


def add_workload_option(parser: argparse.ArgumentParser, presets: Mapping[str, Any]) -> None:
    """`--workload NAME`: one of the benchmark's presets (`workloads`), `default` unless given."""
    described = "; ".join(f"{name}: {w.what}" for name, w in presets.items())
    parser.add_argument(
        "--workload",
        choices=list(presets),
        default="default",
        metavar="NAME",
        help=f"the workload, one of: {described}",
    )


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def comma_list(
    choices: Sequence[str] | None = None, *, low: int | None = None, high: int | None = None
) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of distinct items, each one of
    `choices`, or (without choices) an integer in [low, high]."""
    if choices is not None:
        what = f"a comma-separated list of {', '.join(choices)}"
    else:
        what = "a comma-separated list of integers" + (
            f" in [{low}, {high}]"
            if low is not None and high is not None
            else f" of at least {low}"
            if low is not None
            else ""
        )

    def parse(text: str) -> list:
        items: list = [x.strip() for x in text.split(",") if x.strip()]
        if choices is None:
            try:
                items = [int(x) for x in items]
            except ValueError:
                items = []
            ok = all((low is None or v >= low) and (high is None or v <= high) for v in items)
        else:
            ok = all(x in choices for x in items)
        if not items or not ok:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"an item is named twice in {text!r}")
        return items

    return parse


def run(
    name: str,
    args: argparse.Namespace,
    measure: Callable[[argparse.Namespace], dict],
    tables: Callable[[dict], list[Table]],
) -> int:
    """Measure, record where and when, then print the tables and/or write the JSON."""
    destination = getattr(args, "json", None)
    if destination not in (None, STDOUT) and not Path(destination).resolve().parent.is_dir():
        from pagedkv_base.settings import CliError

        raise CliError(f"--json {destination}: no folder {Path(destination).parent}")
    recorded = environment(name, args)
    report = measure(args)
    recorded["load_average_1m_end"] = load_average()
    report["environment"] = recorded
    if destination == STDOUT:
        print(json.dumps(report, indent=2))
        return 0
    if destination is not None:
        Path(destination).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print_tables(tables(report))
    return 0


def environment(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The command, the machine and the date of a run, as its report records them."""
    return {
        "benchmark": name,
        "command": command_line(name, args),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        # Other work on the machine slows every figure: say how busy it was.
        "load_average_1m_start": load_average(),
        "python": platform.python_version(),
        # the allocator core's build: "mypyc" (compiled) or "python" (source)
        "core_build": native.BUILD,
    }


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                model,
            )
    except OSError:
        pass
    memory = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        memory = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {
        "cpu_model": model,
        "cpu_cores": os.cpu_count(),
        "memory_gib": memory,
        "os": platform.system(),
    }


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def command_line(name: str, args: argparse.Namespace) -> str:
    """`pagedkv bench NAME` and every option that differs from its default, as
    a user would type it to run the same benchmark again."""
    parser: argparse.ArgumentParser | None = getattr(args, "_bench_parser", None)
    if parser is None:  # called without the `pagedkv` command: its own command line
        return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    words, positional = ["pagedkv", "bench", name], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        if not action.option_strings:  # after the options, as typed (a REMAINDER last)
            positional += value if isinstance(value, list) else [str(value)]
            continue
        flag = (
            max(action.option_strings, key=len) if action.nargs != 0 else action.option_strings[0]
        )
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(action.option_strings[0] if value else action.option_strings[1])
        elif action.nargs == 0 or (action.nargs == "?" and value == action.const):
            words.append(flag)
        else:
            words += [
                flag,
                ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value),
            ]
    return shlex.join(words + positional)


# -- tables -------------------------------------------------------------------------------


def print_tables(tables: Iterable[Table]) -> None:
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console(width=None if sys.stdout.isatty() else 160)
    for table in tables:
        grid = RichTable(title=table.title)
        for i, column in enumerate(table.columns):
            grid.add_column(column, justify="left" if i == 0 else "right")
        for row in table.rows:
            grid.add_row(*row)
        console.print(grid)
        for note in table.notes:
            console.print(note, highlight=False, markup=False)


def markdown(table: Table) -> str:
    """The table in GitHub Markdown: its title in bold, the grid, then its notes as a list."""

    def line(cells: Iterable[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    out = [
        f"**{table.title}**",
        "",
        line(table.columns),
        "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(table.columns))) + " |",
    ]
    out += [line(row) for row in table.rows]
    if table.notes:
        out += ["", *(f"- {note}" for note in table.notes)]
    return "\n".join(out)


# -- statistics and conditions -------------------------------------------------------------


def sse_chunk(line: str) -> dict[str, Any] | None:
    """The JSON of one line of an OpenAI-style event stream: None for a line
    that is not `data: ...` and for the closing `data: [DONE]`."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[6:])


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The nearest-rank `q` quantile (0 < q <= 1) of the
    values that are numbers; None if none are."""
    ordered = sorted(v for v in values if v is not None and v == v)
    if not ordered:
        return None
    rank = math.ceil(q * len(ordered) - 1e-9)  # the first rank that covers q of the values
    return ordered[min(max(rank, 1), len(ordered)) - 1]


def mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to 3 places; None when either is not measured (or b is 0)."""
    return round(a / b, 3) if a is not None and b else None


def interleaved(names: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, name) for `rounds` rounds of every name, each round starting one
    name later, so that no system always runs right after the same other."""
    names = list(names)
    for r in range(rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            yield r, name


class OtherCpu:
    """The share of the machine's CPU time that OTHER processes (or the
    hypervisor, as steal) took between `start()` and `share()`: 0 on a quiet
    machine; timings from a busy one are pessimistic. None off Linux."""

    def __init__(self) -> None:
        self._before = _cpu_snapshot()

    def share(self) -> float | None:
        before, after = self._before, _cpu_snapshot()
        if before is None or after is None:
            return None
        others = (after[0] - before[0]) - (after[1] - before[1])
        capacity = (after[2] - before[2]) * (os.cpu_count() or 1)
        return round(min(1.0, max(0.0, others / capacity)), 3) if capacity > 0 else None


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(machine busy CPU seconds incl. steal, this process's CPU seconds, wall clock)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy.
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.perf_counter()


def metric_samples(url: str) -> Iterator[Any]:
    """Every sample a server's Prometheus endpoint at `url` (its /metrics) exposes now."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url = url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - our own loopback servers
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        yield from family.samples


def tier_bytes(urls: Iterable[str]) -> dict[str, float]:
    """The KV tiers' saved and loaded bytes so far, "saved:TIER" / "loaded:TIER", summed over
    the workers at `urls` (absent: not exported)."""
    got: dict[str, float] = {}
    for url in urls:
        for s in metric_samples(url):
            for what in ("saved", "loaded"):
                if s.name == f"pagedkv_worker_kv_tier_{what}_bytes_total":
                    key = f"{what}:{s.labels.get('tier', '')}"
                    got[key] = got.get(key, 0.0) + s.value
    return got


def log(name: str, message: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(f"[bench {name}] {message}", file=sys.stderr, flush=True)
