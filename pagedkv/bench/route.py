"""`pagedkv bench route`: the router's policies side by side on a multi-tenant workload.

Systems (`systems.routers`): two workers of `num_blocks` blocks each
behind one router per policy (`kv`, `least-load`, `round-robin`) and behind a
`kv` router asking MatchPrefix per request (`kv-match-prefix`); and one
worker with both pools' memory (2 x `num_blocks`), behind no router.

Workload (`workloads.ROUTE`, `--workload`; `workloads.tenant_conversations`):
`tenants` tenants, each with a system prompt of about `prompt_tokens` tokens,
and `conversations` conversations per tenant, all arrivals shuffled together
and sent with `concurrency` in flight, streamed, greedy, `max_tokens` tokens
each (EOS ignored, so every run does the same work). `tight` is the setting
where routing must hold under load: the pools hold exactly the working set
when each worker keeps its own half of the prefixes.

`--background-load N` runs N CPU-bound processes (each spinning on one core)
beside the stack for the duration of the rounds: the machine as busy as a
shared host, where routing decisions meet late views and queue spikes.

Runs are interleaved: each of `rounds` rounds runs every policy and the
reference once, in a rotated order. Each run salts every request with its
own `cache_salt`, so no run finds another's prefixes cached (their blocks
are junk it must evict, like any warm pool's).

Figures per run, then the mean over rounds per policy:
- hit rate: prompt tokens found in a prefix cache / prompt tokens admitted,
  from the workers' own counters (deltas over the run); also its lowest and
  highest over the rounds, and each round's;
- tokens/s: generated tokens / wall time of the run;
- TTFT p50 / p95: request sent -> first streamed token, at the client;
- routing ms p50: the router's time to choose (its `x-pagedkv-routing-ms`);
- busiest worker's share: the most requests any one worker answered over all
  answered (0.5 is an even split over two; 1.0 for the reference);
- per round, kv's hit rate over the reference's and kv's tokens/s over
  round-robin's (the targets hold in every round: their worst round);
- the most kv's tokens/s could be over round-robin's on the workload
  (`kv_tokens_per_s_over_round_robin_bound`): were computing prompt tokens
  all the work and kv's hit rate the reference's, (1 - round-robin's hit
  rate) / (1 - the reference's);
- and once, the router's added latency end to end: `probe_requests`
  sequential one-token completions in turn to a worker directly, to the kv
  router and to a kv router asking MatchPrefix per request
  (`PAGEDKV_ROUTER_CACHE_VIEW=match-prefix`), p50 of each and the difference; with a prompt of a few
  whole blocks (the prompt is matched: `added_p50_ms`,
  `match_prefix_added_p50_ms`) and with one under a block (nothing to
  match: `short_prompt_added_p50_ms`, ...).
Not a timed test: compare the figures within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.systems.routers import ASKING, POLICIES, REFERENCE, Target, topology
from pagedkv.bench.workloads import ROUTE, RouteWorkload, tenant_conversations

__all__ = ["ASKING", "POLICIES", "REFERENCE", "add_arguments", "measure", "run", "tables"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_workload_option(p, ROUTE)
    p.add_argument(
        "--background-load",
        type=_count,
        default=0,
        metavar="N",
        help="N CPU-bound processes running beside the stack during the rounds (default 0)",
    )
    harness.add_json_option(p)


def _count(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    return 0 if text.strip() == "0" else harness.positive(text)


_count.__name__ = "count"


def _spin() -> None:
    """A CPU-bound process: spins until it is terminated."""
    n = 0
    while True:
        n = (n * 1103515245 + 12345) & 0xFFFFFFFF


@contextlib.contextmanager
def background_load(n: int) -> Iterator[None]:
    """`n` spinning processes while inside, ended on the way out."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process with event loops and threads
    procs = [ctx.Process(target=_spin, name=f"background-load-{i}", daemon=True) for i in range(n)]
    try:
        for proc in procs:
            proc.start()
        yield
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(10)


async def _one(
    client, url: str, messages: list[dict], model: str, max_tokens: int, salt: str
) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {(await r.aread())[:200]!r}"}
        routing_ms = float(r.headers.get("x-pagedkv-routing-ms", "nan"))
        worker = r.headers.get("x-pagedkv-worker", url)
        async for line in r.aiter_lines():
            if (chunk := harness.sse_chunk(line)) is None:
                continue
            if "error" in chunk:
                return {"error": chunk["error"].get("message", "")}
            if (
                ttft is None
                and chunk.get("choices")
                and chunk["choices"][0]["delta"].get("content")
            ):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": ttft, "tokens": tokens, "routing_ms": routing_ms, "worker": worker}


async def _run(
    url: str, workload: list[list[dict]], w: RouteWorkload, salt: str
) -> tuple[list[dict], float]:
    import httpx

    sem = asyncio.Semaphore(w.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(messages):
            async with sem:
                return await _one(client, url, messages, w.model, w.max_tokens, salt)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(m) for m in workload))
        return results, time.perf_counter() - t0


def _prefix_counters(urls) -> tuple[float, float]:
    """(hit, queried) prompt tokens, summed over the workers at `urls`."""
    hit = queried = 0.0
    for url in urls:
        for s in harness.metric_samples(url):
            if s.name == "pagedkv_worker_prefix_cache_hit_tokens_total":
                hit += s.value
            elif s.name == "pagedkv_worker_prefix_cache_queried_tokens_total":
                queried += s.value
    return hit, queried


def _routing_split(url: str) -> dict[str, float | None]:
    """The kv router's mean routing time and its matching part (in its view; MatchPrefix while
    the view was not in step), over the whole bench."""
    got: dict[str, float] = {}
    for s in harness.metric_samples(url):
        if s.name.endswith(("_seconds_sum", "_seconds_count")):
            got[s.name] = got.get(s.name, 0.0) + s.value

    def mean(name: str) -> float | None:
        n = got.get(f"{name}_count", 0.0)
        return round(1000 * got.get(f"{name}_sum", 0.0) / n, 3) if n else None

    return {
        "kv_routing_mean_ms": mean("pagedkv_router_routing_seconds"),
        "kv_view_match_mean_ms": mean("pagedkv_router_view_match_seconds"),
        "kv_match_prefix_mean_ms": mean("pagedkv_router_match_prefix_seconds"),
    }


def _rounded(value: float | None, digits: int, scale: float = 1.0) -> float | None:
    return None if value is None else round(scale * value, digits)


def _figures(results: list[dict], wall: float, hit: float, queried: float) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    per_worker = Counter(r["worker"] for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "hit_rate": round(hit / queried, 4) if queried else None,
        "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2),
        "ttft_p50_ms": _rounded(harness.percentile(ttft, 0.5), 2, 1000),
        "ttft_p95_ms": _rounded(harness.percentile(ttft, 0.95), 2, 1000),
        "routing_ms_p50": harness.percentile([r["routing_ms"] for r in ok], 0.5),
        # how evenly the requests were spread: the busiest worker's share (0.5 = even over two)
        "busiest_worker_share": round(max(per_worker.values()) / len(ok), 4) if ok else None,
        "wall_s": round(wall, 3),
    }


# The probe's prompts: one of several whole blocks (the router asks MatchPrefix:
# the figure the target is about), and one shorter than a block (no pool can
# hold any of it, so the router does not ask).
PROBE_PROMPT = (
    "Latency probe: the same prompt every time, long enough to fill a few whole blocks. " * 3
)
PROBE_SHORT_PROMPT = "Latency probe."


async def _probe(
    direct: str, routed: dict[str, str], model: str, n: int, prompt: str
) -> dict[str, Any]:
    """Sequential one-token completions, in turn to `direct` and to each of
    `routed` (name -> router URL); each router's p50 less direct's."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    targets = [("direct", direct), *routed.items()]
    times: dict[str, list[float]] = {name: [] for name, _ in targets}
    async with httpx.AsyncClient(timeout=60) as client:
        for _, url in targets:  # warm every path's connections
            await client.post(f"{url}/v1/completions", json=body)
        for i in range(len(targets) * n):
            name, url = targets[i % len(targets)]
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/completions", json=body)
            if r.status_code == 200:
                times[name].append(time.perf_counter() - t0)
    p50 = {name: statistics.median(t) for name, t in times.items()}
    out = {"requests_each": n, "direct_p50_ms": round(1000 * p50["direct"], 3)}
    for name in routed:
        prefix = "" if name == "kv" else f"{name.removeprefix('kv-').replace('-', '_')}_"
        out[f"{prefix}routed_p50_ms"] = round(1000 * p50[name], 3)
        out[f"{prefix}added_p50_ms"] = round(1000 * (p50[name] - p50["direct"]), 3)
    return out


def _probes(direct: str, routed: dict[str, str], model: str, n: int) -> dict[str, Any]:
    whole = asyncio.run(_probe(direct, routed, model, n, PROBE_PROMPT))
    short = asyncio.run(_probe(direct, routed, model, n, PROBE_SHORT_PROMPT))
    return whole | {f"short_prompt_{k}": v for k, v in short.items() if k != "requests_each"}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv_base.model_files import load_tokenizer

    w = ROUTE[args.workload]
    workload = tenant_conversations(
        load_tokenizer(w.model), w.tenants, w.prompt_tokens, w.conversations, w.seed
    )
    runs: dict[str, list[dict]] = {name: [] for name in (*POLICIES, ASKING, REFERENCE)}
    with topology(w.model, w.num_blocks, w.block_size, w.concurrency) as systems:
        for name, target in systems.targets.items():  # warm-up: each path once, its own salt
            asyncio.run(_run(target.url, workload[:2], w, f"warmup-{name}"))
        with background_load(args.background_load):
            for rnd, name in harness.interleaved(list(systems.targets), w.rounds):
                runs[name].append(
                    _one_run(systems.targets[name], workload, w, f"round{rnd}-{name}")
                )
        probe = _probes(
            systems.direct,
            {"kv": systems.targets["kv"].url, ASKING: systems.targets[ASKING].url},
            w.model,
            w.probe_requests,
        )
        probe |= _routing_split(systems.kv_router)
    return _report(w, args.background_load, runs, probe)


def _one_run(
    target: Target, workload: list[list[dict]], w: RouteWorkload, salt: str
) -> dict[str, Any]:
    """The whole workload through `target`, salted so that no
    other run's prefixes are cached for it."""
    hit0, queried0 = _prefix_counters(target.workers)
    results, wall = asyncio.run(_run(target.url, workload, w, salt))
    hit1, queried1 = _prefix_counters(target.workers)
    return _figures(results, wall, hit1 - hit0, queried1 - queried0)


def _spread(rows: list[dict]) -> dict[str, Any]:
    """The hit rate's lowest, highest and each round's, over a policy's runs."""
    rates = [r["hit_rate"] for r in rows]
    present = [r for r in rates if r is not None]
    return {
        "hit_rate_min": min(present) if present else None,
        "hit_rate_max": max(present) if present else None,
        "hit_rate_per_round": rates,
    }


def _per_round(runs: dict[str, list[dict]]) -> dict[str, list[float | None]]:
    """The targets' ratios round by round (the runs of one round share the machine's conditions)."""
    return {
        "kv_hit_rate_of_one_worker_with_both_pools": [
            harness.ratio(a["hit_rate"], b["hit_rate"])
            for a, b in zip(runs["kv"], runs[REFERENCE], strict=True)
        ],
        "kv_tokens_per_s_over_round_robin": [
            harness.ratio(a["tokens_per_s"], b["tokens_per_s"])
            for a, b in zip(runs["kv"], runs["round-robin"], strict=True)
        ],
    }


def _prefill_bound(summary: dict) -> float | None:
    """The most kv's tokens/s could be over round-robin's on this workload:
    were computing prompt tokens all the work, and kv's hit rate the
    ceiling's (one worker with both pools), (1 - round-robin's hit rate) /
    (1 - the ceiling's)."""
    rr, ref = summary["round-robin"]["hit_rate"], summary[REFERENCE]["hit_rate"]
    return None if rr is None or ref is None else harness.ratio(1 - rr, 1 - ref)


def _report(
    w: RouteWorkload, background_load: int, runs: dict[str, list[dict]], probe: dict
) -> dict[str, Any]:
    def mean(rows: list[dict], key: str) -> float | None:
        value = harness.mean(r.get(key) for r in rows)
        return None if value is None else round(value, 4)

    summary = {
        name: {
            k: mean(rows, k)
            for k in (
                "hit_rate",
                "tokens_per_s",
                "ttft_p50_ms",
                "ttft_p95_ms",
                "routing_ms_p50",
                "busiest_worker_share",
            )
        }
        | _spread(rows)
        | {"errors": sum(r["errors"] for r in rows)}
        for name, rows in runs.items()
    }
    kv, rr, ref = summary["kv"], summary["round-robin"], summary[REFERENCE]

    per_round = _per_round(runs)

    def worst(values: list[float | None]) -> float | None:
        return None if not values or None in values else min(values)

    return {
        "workload": {
            "model": w.model,
            "tenants": w.tenants,
            "prompt_tokens": w.prompt_tokens,
            "conversations_per_tenant": w.conversations,
            "requests_per_run": w.tenants * w.conversations,
            "concurrency": w.concurrency,
            "max_tokens": w.max_tokens,
            "workers": 2,
            "num_blocks_per_worker": w.num_blocks,
            "block_size": w.block_size,
            "rounds": w.rounds,
            "background_load": background_load,
        },
        "summary": summary,
        "targets": {
            "kv_hit_rate_of_one_worker_with_both_pools": harness.ratio(
                kv["hit_rate"], ref["hit_rate"]
            ),
            "kv_tokens_per_s_over_round_robin": harness.ratio(
                kv["tokens_per_s"], rr["tokens_per_s"]
            ),
            "kv_ttft_p50_of_round_robin": harness.ratio(kv["ttft_p50_ms"], rr["ttft_p50_ms"]),
            "router_added_p50_ms": probe["added_p50_ms"],
            "kv_hit_rate_of_one_worker_with_both_pools_worst_round": worst(
                per_round["kv_hit_rate_of_one_worker_with_both_pools"]
            ),
            "kv_tokens_per_s_over_round_robin_worst_round": worst(
                per_round["kv_tokens_per_s_over_round_robin"]
            ),
            "kv_tokens_per_s_over_round_robin_bound": _prefill_bound(summary),
        },
        "per_round": per_round,
        "probe": probe,
        "runs": runs,
    }


def tables(report: dict) -> list[Table]:
    w, g, p = report["workload"], report["targets"], report["probe"]
    runs = report["runs"]
    # from the runs: reports of any age
    spreads = {name: _spread(rows) for name, rows in runs.items()}
    per_round = _per_round(runs)
    rows = [
        [
            name,
            cell(s["hit_rate"], ".1%"),
            cell(spreads[name]["hit_rate_min"], ".1%"),
            cell(spreads[name]["hit_rate_max"], ".1%"),
            cell(s["tokens_per_s"], ".1f"),
            cell(s["ttft_p50_ms"]),
            cell(s["ttft_p95_ms"]),
            cell(s["routing_ms_p50"]),
            cell(s["busiest_worker_share"]),
            cell(s["errors"]),
        ]
        for name, s in report["summary"].items()
    ]
    notes = [
        "hit rate per round: "
        + "; ".join(
            f"{name} {cell(spreads[name]['hit_rate_per_round'], '.1%')}"
            for name in report["summary"]
        ),
        f"per round, kv hit rate / one worker with both pools: "
        f"{cell(per_round['kv_hit_rate_of_one_worker_with_both_pools'])} (target >= 0.9 in every "
        "round); kv tokens/s / round-robin: "
        f"{cell(per_round['kv_tokens_per_s_over_round_robin'])} (target >= 1.5)",
        "kv hit rate / one worker with both pools: "
        f"{cell(g['kv_hit_rate_of_one_worker_with_both_pools'])} (target >= 0.9); kv tokens/s / "
        f"round-robin: {cell(g['kv_tokens_per_s_over_round_robin'])} (target >= 1.5; at most "
        f"{cell(_prefill_bound(report['summary']))} on this workload, were prompt tokens all the "
        "work: (1 - round-robin's hit rate) / (1 - the one worker's)); kv TTFT p50 "
        f"/ round-robin: {cell(g['kv_ttft_p50_of_round_robin'])} (target <= 0.6)",
        f"router added latency p50 (sequential 1-token requests, a prompt of whole blocks): "
        f"{cell(p['routed_p50_ms'])} ms routed vs {cell(p['direct_p50_ms'])} ms direct = "
        f"+{cell(p['added_p50_ms'])} ms (target <= 2); a prompt under one block (nothing to "
        f"match): +{cell(p['short_prompt_added_p50_ms'])} ms",
        f"the same, kv asking MatchPrefix per request (PAGEDKV_ROUTER_CACHE_VIEW=match-prefix): "
        f"+{cell(p['match_prefix_added_p50_ms'])} ms (under one block: "
        f"+{cell(p['short_prompt_match_prefix_added_p50_ms'])} ms)",
        f"kv routing time, mean over the bench: {cell(p['kv_routing_mean_ms'])} ms, of which "
        f"matching in its view {cell(p['kv_view_match_mean_ms'])} ms (MatchPrefix, while the view "
        f"was not in step: {cell(p['kv_match_prefix_mean_ms'])} ms)",
    ]
    return [
        Table(
            title=f"pagedkv bench route: {w['tenants']} tenants x {w['conversations_per_tenant']} "
            f"conversations, ~{w['prompt_tokens']}-token system prompts, 2 workers x "
            f"{w['num_blocks_per_worker']} blocks ({w['model']}), "
            f"mean of {w['rounds']} interleaved rounds"
            + (
                f", {w['background_load']} CPU-bound processes beside the stack"
                if w.get("background_load")
                else ""
            ),
            columns=[
                "policy",
                "hit rate",
                "hit rate min",
                "hit rate max",
                "tokens/s",
                "TTFT p50 ms",
                "TTFT p95 ms",
                "routing ms p50",
                "busiest worker's share",
                "errors",
            ],
            rows=rows,
            notes=notes,
        )
    ]


def figures(report: dict) -> dict[str, tuple[float | None, bool]]:
    """The headline figures (`bench compare`): each system's hit rate, tokens/s and TTFT p50,
    and the router's added latency; (value, lower is better)."""
    out: dict[str, tuple[float | None, bool]] = {}
    for name, s in report["summary"].items():
        out[f"{name} hit rate"] = (s.get("hit_rate"), False)
        out[f"{name} tokens/s"] = (s.get("tokens_per_s"), False)
        out[f"{name} TTFT p50 ms"] = (s.get("ttft_p50_ms"), True)
    out["router added p50 ms"] = (report["probe"].get("added_p50_ms"), True)
    return out


def run(args: argparse.Namespace) -> int:
    return harness.run("route", args, measure, tables)
