"""`pagedkv bench NAME`: benchmarks that print a table and write JSON with --json.

Each benchmark module exposes `add_arguments(parser)`, `measure(args)` (the
report), `tables(report)` and `run(args)` (`harness.run`: the report with the
command, machine and date of the run, printed as tables or written as JSON).
`pagedkv bench report` renders the committed results (`docs/benchmarks/*.json`)
as `docs/benchmarks.md`. Workloads are in `workloads` (a benchmark runs one
of its presets: `--workload NAME`), the systems compared in `systems` (a
benchmark's few flags choose among them). Benchmarks are never timed
assertions: they report figures to compare side by side in one run.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "core": ("pagedkv.bench.core", "allocator core operations per second (in-process)"),
    "allocator": (
        "pagedkv.bench.allocator",
        "Step latency: in-process vs gRPC vs gRPC + Redis journal",
    ),
    "attention": ("pagedkv.bench.attention", "paged vs contiguous attention time on the same data"),
    "serve": ("pagedkv.bench.serve", "this engine vs transformers generate on one workload"),
    "reservation": (
        "pagedkv.bench.reservation",
        "paging vs reserving each request's KV slots up front (max, pow2, "
        "oracle) on a simulated GPU: the highest request rate under a latency bound",
    ),
    "route": (
        "pagedkv.bench.route",
        "the router's policies (kv, least-load, round-robin) on a multi-tenant workload",
    ),
    "restart": (
        "pagedkv.bench.restart",
        "the allocator restarted under load: failed requests and wrong texts",
    ),
    "tiers": (
        "pagedkv.bench.tiers",
        "the KV tiers (none, host, host + shared store) on multi-turn chats",
    ),
    "pd": (
        "pagedkv.bench.pd",
        "prefill/decode disaggregation (1 prefill + 1 decode worker) against 2 colocated "
        "workers on chats mixed with long documents: TTFT, ITL, goodput, bytes moved",
    ),
    "host": (
        "pagedkv.bench.host",
        "the host's time per step against a simulated GPU (sim:h100): device busy ratio, "
        "TPOT, host ms per step by part, in-process and gRPC allocator",
    ),
    "fleet": (
        "pagedkv.bench.fleet",
        "N workers' recorded Step streams replayed against one allocator process (or "
        "M sharded): Step p50/p99, device idle from "
        "allocator waits, allocator CPU and RSS, the knee",
    ),
    "attacks": (
        "pagedkv.bench.attacks",
        "the trust-boundary attacks on a stack with credentials and one without: "
        "the victim's p99, the allocator's RSS and threads",
    ),
    "kv-dtype": (
        "pagedkv.bench.kv_dtype",
        "an fp8 KV cache against the model's dtype through /v1/completions: "
        "logprob differences, greedy agreement, multiple-choice accuracy, pool blocks",
    ),
    "compare": (
        "pagedkv.bench.compare",
        "one benchmark run by another checkout and by this one in turn: "
        "each headline figure within noise, better or worse",
    ),
}
REPORT = ("pagedkv.bench.report", "render the committed benchmark results (JSON) as Markdown")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="benchmarks (print a table; write JSON with --json)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, (module_name, help_text) in {**BENCHMARKS, "report": REPORT}.items():
        bp = bsub.add_parser(name, help=help_text, description=help_text)
        bp.set_defaults(_bench_module=module_name, _bench_parser=bp)
        try:
            importlib.import_module(module_name).add_arguments(bp)
        except ModuleNotFoundError:
            bp.set_defaults(_bench_missing=True)
    return p


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_bench_missing", False):
        from pagedkv_base.settings import CliError

        raise CliError(f"benchmark {args.bench!r} is not available in this build")
    return importlib.import_module(args._bench_module).run(args)
