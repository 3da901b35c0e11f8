"""`pagedkv bench route`: the router's policies side by side on a multi-tenant workload.

Topology (real processes, `pagedkv.stack`): one allocator, two workers whose
pools each hold only part of the tenants' prefixes (`--num-blocks`), and one
router per policy (`kv`, `least-load`, `round-robin`) in front of the same
two workers, and a `kv` router asking MatchPrefix per request
(`kv-match-prefix`: the default `kv` matches in its copy of the pools'
caches, kept from the allocator's events); plus a reference worker alone
with both pools' memory (2 x `--num-blocks`, its own embedded allocator,
not behind any router).

Workload: `--prompts` tenants, each with a system prompt of about
`--prompt-tokens` tokens, and `--conversations` conversations per tenant
(distinct user questions), all arrivals shuffled together and sent with
`--concurrency` in flight, streamed, greedy, `--max-tokens` tokens each
(EOS ignored, so every run does the same work).

Runs are interleaved: each of `--rounds` rounds runs every policy and the
reference once, in a rotated order. Each run salts every request with its
own `cache_salt`, so no run finds another's prefixes cached (their blocks
are junk it must evict, like any warm pool's).

Figures per run, then the mean over rounds per policy:
- hit rate: prompt tokens found in a prefix cache / prompt tokens admitted,
  from the workers' own counters (deltas over the run);
- tokens/s: generated tokens / wall time of the run;
- TTFT p50 / p95: request sent -> first streamed token, at the client;
- routing ms p50: the router's time to choose (its `x-pagedkv-routing-ms`);
- busiest worker's share: the most requests any one worker answered over all
  answered (0.5 is an even split over two; 1.0 for the reference);
- and once, the router's added latency end to end: `--probe-requests`
  sequential one-token completions in turn to a worker directly, to the kv
  router and to a kv router asking MatchPrefix per request (`--cache-view
  match-prefix`), p50 of each and the difference; with a prompt of a few
  whole blocks (the prompt is matched: `added_p50_ms`,
  `match_prefix_added_p50_ms`) and with one under a block (nothing to
  match: `short_prompt_added_p50_ms`, ...).
Not a timed test: compare the figures within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from typing import Any

POLICIES = ("kv", "least-load", "round-robin")
REFERENCE = "one-worker-2x-memory"
ASKING = "kv-match-prefix"  # kv asking MatchPrefix per request: the cache view's comparison
WORDS = ("account", "billing", "cluster", "deploy", "engine", "fault", "gateway", "host", "index", "journal",
         "kernel", "latency", "memory", "network", "object", "packet", "queue", "replica", "storage", "tenant",
         "upgrade", "volume", "window", "yield", "zone")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-random", help="model of the workers and routers (default tiny-random)")
    p.add_argument("--prompts", type=int, default=8, help="tenants, one system prompt each (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=400, help="tokens per system prompt (default 400)")
    p.add_argument("--conversations", type=int, default=8, help="conversations per tenant (default 8)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    p.add_argument("--num-blocks", type=int, default=128,
                   help="KV blocks per worker: a part of the prefixes only (default 128 of 16 tokens)")
    p.add_argument("--block-size", type=int, default=16, help="token slots per block (default 16)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--probe-requests", type=int, default=40,
                   help="sequential requests for the router's added latency, each way (default 40)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def build_workload(tokenizer, prompts: int, prompt_tokens: int, conversations: int,
                   seed: int) -> list[list[dict]]:
    """Chat message lists, tenants' conversations shuffled together."""
    rng = random.Random(seed)
    systems = []
    for i in range(prompts):
        words = [f"You are the assistant of tenant {i}. Their systems:"]
        while len(tokenizer.encode(" ".join(words))) < prompt_tokens:
            words.append(rng.choice(WORDS))
        systems.append(" ".join(words))
    requests = [[{"role": "system", "content": systems[i]},
                 {"role": "user", "content": f"Question {j} of tenant {i}: what about the {rng.choice(WORDS)}?"}]
                for i in range(prompts) for j in range(conversations)]
    rng.shuffle(requests)
    return requests


async def _one(client, url: str, messages: list[dict], model: str, max_tokens: int, salt: str) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {(await r.aread())[:200]!r}"}
        routing_ms = float(r.headers.get("x-pagedkv-routing-ms", "nan"))
        worker = r.headers.get("x-pagedkv-worker", url)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"].get("message", "")}
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": ttft, "tokens": tokens, "routing_ms": routing_ms, "worker": worker}


async def _run(url: str, workload: list[list[dict]], args, salt: str) -> tuple[list[dict], float]:
    import httpx

    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(messages):
            async with sem:
                return await _one(client, url, messages, args.model, args.max_tokens, salt)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(m) for m in workload))
        return results, time.perf_counter() - t0


def _prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(hit, queried) prompt tokens, summed over the workers at `urls`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    hit = queried = 0.0
    for url in urls:
        for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for s in fam.samples:
                if s.name == "pagedkv_worker_prefix_cache_hit_tokens_total":
                    hit += s.value
                elif s.name == "pagedkv_worker_prefix_cache_queried_tokens_total":
                    queried += s.value
    return hit, queried


def _routing_split(url: str) -> dict[str, float | None]:
    """The kv router's mean routing time and its matching part (in its view; MatchPrefix while
    the view was not in step), over the whole bench."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    got: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name.endswith(("_seconds_sum", "_seconds_count")):
                got[s.name] = got.get(s.name, 0.0) + s.value

    def mean(name: str) -> float | None:
        n = got.get(f"{name}_count", 0.0)
        return round(1000 * got.get(f"{name}_sum", 0.0) / n, 3) if n else None

    return {"kv_routing_mean_ms": mean("pagedkv_router_routing_seconds"),
            "kv_view_match_mean_ms": mean("pagedkv_router_view_match_seconds"),
            "kv_match_prefix_mean_ms": mean("pagedkv_router_match_prefix_seconds")}


def _pct(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None and v == v)
    if not values:
        return None
    return values[min(int(q * len(values)), len(values) - 1)]


def _figures(results: list[dict], wall: float, hit: float, queried: float) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    per_worker = Counter(r["worker"] for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "hit_rate": round(hit / queried, 4) if queried else 0.0,
        "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2),
        "ttft_p50_ms": round(1000 * _pct(ttft, 0.5), 2) if ok else None,
        "ttft_p95_ms": round(1000 * _pct(ttft, 0.95), 2) if ok else None,
        "routing_ms_p50": _pct([r["routing_ms"] for r in ok], 0.5),
        # how evenly the requests were spread: the busiest worker's share (0.5 = even over two)
        "busiest_worker_share": round(max(per_worker.values()) / len(ok), 4) if ok else None,
        "wall_s": round(wall, 3),
    }


# The probe's prompts: one of several whole blocks (the router asks MatchPrefix:
# the figure the target is about), and one shorter than a block (no pool can
# hold any of it, so the router does not ask).
PROBE_PROMPT = "Latency probe: the same prompt every time, long enough to fill a few whole blocks. " * 3
PROBE_SHORT_PROMPT = "Latency probe."


async def _probe(direct: str, routed: dict[str, str], model: str, n: int, prompt: str) -> dict[str, Any]:
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


def run(args: argparse.Namespace) -> int:
    from pagedkv.stack import LocalStack, RouterProcess, WorkerProcess, stop_processes
    from pagedkv_base.model_files import load_tokenizer
    from pagedkv_base.settings import CliError

    if min(args.prompts, args.prompt_tokens, args.conversations, args.concurrency, args.max_tokens,
           args.num_blocks, args.rounds, args.probe_requests) < 1:
        raise CliError("every count must be positive")
    workload = build_workload(load_tokenizer(args.model), args.prompts, args.prompt_tokens,
                              args.conversations, args.seed)
    worker_args = ["--log-level", "warning", "--block-size", str(args.block_size), "--enable-prefix-caching",
                   "--max-num-seqs", str(args.concurrency)]
    runs: dict[str, list[dict]] = {name: [] for name in (*POLICIES, ASKING, REFERENCE)}
    routers: dict[str, RouterProcess] = {}
    with LocalStack(workers=2, model=args.model, worker_args=[*worker_args, "--num-blocks", str(args.num_blocks)],
                    startup_timeout=300) as stack:
        single = WorkerProcess("reference", model=args.model,  # embedded allocator: no router sees it
                               args=[*worker_args, "--num-blocks", str(2 * args.num_blocks)])
        try:
            single.start()
            for policy in POLICIES:
                routers[policy] = RouterProcess(f"router-{policy}", allocator=stack.allocator_address,
                                                model=args.model, args=["--policy", policy, "--log-level", "warning",
                                                                        *stack.router_credentials])
                routers[policy].start()
            # kv asking MatchPrefix per request (the default keeps the allocator's
            # view from its events), side by side with it, in the rounds and the probe.
            routers[ASKING] = RouterProcess(f"router-{ASKING}", allocator=stack.allocator_address, model=args.model,
                                            args=["--cache-view", "match-prefix", "--log-level", "warning",
                                                  *stack.router_credentials])
            routers[ASKING].start()
            single.wait_healthy(300)
            for r in routers.values():
                r.wait_healthy(300)
            targets = {**{p: (routers[p].url, stack.worker_urls) for p in (*POLICIES, ASKING)},
                       REFERENCE: (single.url, [single.url])}
            names = list(targets)
            for name, (url, _) in targets.items():  # warm-up: each path once, its own salt
                asyncio.run(_run(url, workload[:2], args, f"warmup-{name}"))
            for rnd in range(args.rounds):
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                    url, counted = targets[name]
                    hit0, queried0 = _prefix_counters(counted)
                    results, wall = asyncio.run(_run(url, workload, args, f"round{rnd}-{name}"))
                    hit1, queried1 = _prefix_counters(counted)
                    runs[name].append(_figures(results, wall, hit1 - hit0, queried1 - queried0))
            probe = _probes(stack.worker_urls[0], {name: routers[name].url for name in ("kv", ASKING)},
                            args.model, args.probe_requests)
            probe |= _routing_split(routers["kv"].url)
        finally:
            stop_processes([[r.proc for r in routers.values() if r.proc is not None]
                            + ([single.proc] if single.proc is not None else [])], 10.0)
    report = _report(args, runs, probe)
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
    return 0


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.mean(values), 4) if values else None


def _report(args, runs: dict[str, list[dict]], probe: dict) -> dict[str, Any]:
    summary = {name: {k: _mean(rows, k) for k in ("hit_rate", "tokens_per_s", "ttft_p50_ms", "ttft_p95_ms",
                                                  "routing_ms_p50", "busiest_worker_share")}
               | {"errors": sum(r["errors"] for r in rows)}
               for name, rows in runs.items()}
    kv, rr, ref = summary["kv"], summary["round-robin"], summary[REFERENCE]

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    return {
        "workload": {"model": args.model, "tenants": args.prompts, "prompt_tokens": args.prompt_tokens,
                     "conversations_per_tenant": args.conversations, "requests_per_run": args.prompts * args.conversations,
                     "concurrency": args.concurrency, "max_tokens": args.max_tokens, "workers": 2,
                     "num_blocks_per_worker": args.num_blocks, "block_size": args.block_size, "rounds": args.rounds},
        "summary": summary,
        "targets": {
            "kv_hit_rate_of_one_worker_with_both_pools": ratio(kv["hit_rate"], ref["hit_rate"]),
            "kv_tokens_per_s_over_round_robin": ratio(kv["tokens_per_s"], rr["tokens_per_s"]),
            "kv_ttft_p50_of_round_robin": ratio(kv["ttft_p50_ms"], rr["ttft_p50_ms"]),
            "router_added_p50_ms": probe["added_p50_ms"],
        },
        "probe": probe,
        "runs": runs,
    }


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    w = report["workload"]
    t = Table(title=f"pagedkv bench route: {w['tenants']} tenants x {w['conversations_per_tenant']} conversations, "
                    f"~{w['prompt_tokens']}-token system prompts, 2 workers x {w['num_blocks_per_worker']} blocks "
                    f"({w['model']}), mean of {w['rounds']} interleaved rounds")
    for col in ("policy", "hit rate", "tokens/s", "TTFT p50 ms", "TTFT p95 ms", "routing ms p50",
                "busiest worker's share", "errors"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for name, s in report["summary"].items():
        t.add_row(name, f"{s['hit_rate']:.1%}", f"{s['tokens_per_s']:.1f}", str(s["ttft_p50_ms"]),
                  str(s["ttft_p95_ms"]), str(s["routing_ms_p50"]), str(s["busiest_worker_share"]), str(s["errors"]))
    c = Console(width=140)
    c.print(t)
    g = report["targets"]
    p = report["probe"]
    c.print(f"kv hit rate / one worker with both pools: {g['kv_hit_rate_of_one_worker_with_both_pools']} "
            f"(target >= 0.9); kv tokens/s / round-robin: {g['kv_tokens_per_s_over_round_robin']} (target >= 1.5); "
            f"kv TTFT p50 / round-robin: {g['kv_ttft_p50_of_round_robin']} (target <= 0.6)")
    c.print(f"router added latency p50 (sequential 1-token requests, a prompt of whole blocks): "
            f"{p['routed_p50_ms']} ms routed vs {p['direct_p50_ms']} ms direct = +{p['added_p50_ms']} ms "
            f"(target <= 2); a prompt under one block (nothing to match): +{p['short_prompt_added_p50_ms']} ms")
    c.print(f"the same, kv asking MatchPrefix per request (--cache-view match-prefix): "
            f"+{p['match_prefix_added_p50_ms']} ms (under one block: +{p['short_prompt_match_prefix_added_p50_ms']} ms)")
    c.print(f"kv routing time, mean over the bench: {p['kv_routing_mean_ms']} ms, of which matching in its view "
            f"{p['kv_view_match_mean_ms']} ms (MatchPrefix, while the view was not in step: "
            f"{p['kv_match_prefix_mean_ms']} ms)")
