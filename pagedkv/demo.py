"""`pagedkv demo`: the main job, end to end on this machine.

Starts the local topology (the allocator service with in-memory state, two
SmolLM2 workers on the CPU and the router in front of them, via
`pagedkv.stack.LocalStack`), sends a realistic chat workload through the
router's OpenAI-style HTTP API (many conversations sharing one system prompt,
mixed lengths, some multi-turn) with a progress bar, and ends with a report
(with the routing figures: requests per worker, prefix tokens cached where
each request went vs the best any worker had, routing time) and a PNG chart
of KV utilisation over the run. Then it shuts everything down.

The workload is `WORKLOAD` (16 conversations in flight, 35% of them
with a second turn, replies of 24 to 72 tokens) on two workers of 80 blocks
each, small enough to show the pool under pressure; `--conversations` sets
how many run, `--policy` the router's policy.

The report's peaks are the workers' own high-water marks, taken at every
engine step (`pagedkv_worker_*_peak`, started again by `POST /reset_peaks`
before the workload): each is the sum over the workers of each worker's peak.
The chart and the mean utilisation come from /metrics polled every 0.25 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

SYSTEM_PROMPT = (
    "You are Paige, the support assistant of a small hosting company. Answer in one or two short, "
    "friendly sentences. If you do not know something, say so plainly. Never invent prices, dates "
    "or policies. Customers run web shops, blogs and small databases on our servers, and most of "
    "them are not technical, so avoid jargon and explain any term you must use."
)

QUESTIONS = [
    "How do I reset my password?",
    "My website is slow today. What can I check first?",
    "What is a backup and how often should I make one?",
    "Can I move my blog from another host to yours?",
    "Why does my shop show a security warning in the browser?",
    "What does it mean that my disk is almost full?",
    "How can I add a second email address to my account?",
    "Is it safe to update my blog plugins?",
    "What is the difference between a domain and hosting?",
    "How do I connect my own domain name to my site?",
    "Can you explain what a database does for my web shop?",
    "Why did I get an email saying my site was down for five minutes?",
    "What should I do if I think my account was hacked?",
    "How can I make my pictures load faster?",
    "Do I need a separate plan for a second website?",
    "What happens to my site if I forget to pay an invoice?",
]
FOLLOW_UPS = [
    "Thanks. Can you say that more simply?",
    "And how long does that usually take?",
    "Is there anything I should avoid doing?",
    "Could you give me the first step only?",
]


@dataclass(frozen=True)
class Workload:
    """What the demo runs, besides the model, the router's policy and how many conversations."""

    workers: int = 2  # behind the router
    multi_turn: float = 0.35  # share of conversations with a second turn
    concurrency: int = 16  # conversations in flight at once
    num_blocks: int = 80  # KV blocks per worker: small enough to show pressure
    block_size: int = 16
    max_model_len: int = 1024  # context cap per conversation
    max_tokens: tuple[int, int] = (24, 72)  # reply length range
    seed: int = 0


WORKLOAD = Workload()


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo",
        help="start the local stack, run a chat workload, print a report and a chart",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="model of the workers (default smollm2)")
    p.add_argument(
        "--policy",
        default="kv",
        choices=("kv", "least-load", "round-robin"),
        help="the router's policy (default kv)",
    )
    p.add_argument(
        "--conversations", type=int, default=32, help="conversations to run (default 32)"
    )
    p.add_argument(
        "--out", default="out", help="folder for the report JSON and the chart (default out/)"
    )
    p.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table"
    )
    return p


async def _poll(urls: list[str], samples: list[dict], stop: asyncio.Event, t0: float) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "pagedkv_worker_kv_blocks_used",
        "pagedkv_worker_kv_blocks_cached",
        "pagedkv_worker_kv_pool_blocks",
        "pagedkv_worker_kv_slot_utilisation_ratio",
        "pagedkv_worker_running_sequences",
        "pagedkv_worker_waiting_sequences",
    }
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            row: dict = {"t": time.monotonic() - t0}
            for url in urls:
                try:
                    text = (await client.get(f"{url}/metrics")).text
                except httpx.HTTPError:
                    continue
                for fam in text_string_to_metric_families(text):
                    for s in fam.samples:
                        if s.name in wanted:
                            key = s.name.removeprefix("pagedkv_worker_")
                            if key == "kv_slot_utilisation_ratio":
                                row.setdefault(key, []).append(s.value)
                            else:
                                row[key] = row.get(key, 0) + s.value
            if "kv_blocks_used" in row:
                row["kv_slot_utilisation_ratio"] = min(
                    row.get("kv_slot_utilisation_ratio") or [1.0]
                )
                samples.append(row)
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.25)
            except TimeoutError:
                pass


async def _conversation(
    client, model: str, rng: random.Random, turns: int, lo: int, hi: int, stats: Stats, bar
) -> None:
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": rng.choice(QUESTIONS)},
    ]
    for turn in range(turns):
        t0 = time.monotonic()
        first = None
        reply = []
        try:
            stream = await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=rng.randint(lo, hi),
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.monotonic() - t0
                    reply.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    stats.completion_tokens += chunk.usage.completion_tokens
                    stats.prompt_tokens += chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    stats.cached_tokens += (details.cached_tokens or 0) if details else 0
        except Exception as exc:  # noqa: BLE001 - report every failure, keep the demo going
            stats.errors.append(repr(exc))
            bar.update(1)
            return
        stats.requests += 1
        if first is not None:
            stats.ttft.append(first)
        bar.update(1)
        if turn + 1 < turns:
            messages += [
                {"role": "assistant", "content": "".join(reply)},
                {"role": "user", "content": rng.choice(FOLLOW_UPS)},
            ]


async def _workload(api: str, key: str, urls: list[str], args) -> tuple[Stats, list[dict], float]:
    """The conversations through `api` (the router) with API key `key`; KV samples polled from
    every worker at `urls`."""
    import httpx
    import openai
    from tqdm import tqdm

    w = WORKLOAD
    lo, hi = w.max_tokens
    rng = random.Random(w.seed)
    turns = [2 if rng.random() < w.multi_turn else 1 for _ in range(args.conversations)]
    stats, samples = Stats(), []
    async with httpx.AsyncClient(timeout=5) as http:  # the peaks count this workload alone
        for url in urls:
            (await http.post(f"{url}/reset_peaks")).raise_for_status()
    stop = asyncio.Event()
    t0 = time.monotonic()
    poller = asyncio.create_task(_poll(urls, samples, stop, t0))
    client = openai.AsyncOpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=600)
    sem = asyncio.Semaphore(w.concurrency)
    with tqdm(total=sum(turns), desc="chat requests", unit="req") as bar:

        async def one(i: int) -> None:
            async with sem:
                await _conversation(
                    client,
                    args.model,
                    random.Random(w.seed * 1000 + i),
                    turns[i],
                    lo,
                    hi,
                    stats,
                    bar,
                )

        await asyncio.gather(*(one(i) for i in range(args.conversations)))
    wall = time.monotonic() - t0
    await asyncio.sleep(0.6)  # one more sample after the last request
    stop.set()
    await poller
    return stats, samples, wall


def _worker_totals(urls: list[str]) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for url in urls:
        for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
            for s in fam.samples:
                if s.name.endswith(("_total", "_peak", "kv_pool_blocks")):
                    totals[s.name] = totals.get(s.name, 0) + s.value
    return totals


def _routing(router_url: str, policy: str) -> dict:
    """The router's figures, read back from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    per_worker: dict[str, int] = {}
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{router_url}/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == "pagedkv_router_requests_total":
                per_worker[s.labels["worker"]] = int(s.value)
            elif (
                s.labels.get("policy", policy) == policy or s.name == "pagedkv_router_retries_total"
            ):
                sums[s.name] = sums.get(s.name, 0) + s.value
    chosen = sums.get("pagedkv_router_prefix_cached_tokens_total", 0)
    best = sums.get("pagedkv_router_prefix_best_cached_tokens_total", 0)
    count = sums.get("pagedkv_router_routing_seconds_count", 0)
    return {
        "policy": policy,
        "requests_per_worker": dict(sorted(per_worker.items())),
        "prompt_tokens": int(sums.get("pagedkv_router_prompt_tokens_total", 0)),
        "prefix_tokens_cached_where_sent": int(chosen),
        "prefix_tokens_cached_best_worker": int(best),
        "cached_where_sent_of_best": round(chosen / best, 3) if best else None,
        "routing_ms_mean": round(
            1000 * sums.get("pagedkv_router_routing_seconds_sum", 0) / count, 3
        )
        if count
        else None,
        "retries": int(sums.get("pagedkv_router_retries_total", 0)),
    }


def _chart(path: Path, samples: list[dict], block_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    total = samples[0].get("kv_pool_blocks", 0) if samples else 0
    ax1.stackplot(
        t,
        [s.get("kv_blocks_used", 0) for s in samples],
        [s.get("kv_blocks_cached", 0) for s in samples],
        labels=["in use", "cached (free, reusable)"],
        colors=["#3b7dd8", "#9cc3f0"],
    )
    if total:
        ax1.axhline(
            total, color="black", linewidth=0.8, linestyle="--", label=f"pool ({int(total)} blocks)"
        )
    ax1.set_ylabel("KV blocks")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title("KV pool over the demo run")
    ax2.plot(
        t,
        [100 * s.get("kv_slot_utilisation_ratio", 1.0) for s in samples],
        color="#2a9d5c",
        label="slots holding tokens / slots allocated",
    )
    ax2.plot(
        t,
        [s.get("running_sequences", 0) for s in samples],
        color="#d8643b",
        label="running sequences",
    )
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("% / count")
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from pagedkv.stack import LocalStack
    from pagedkv_base.settings import CliError

    w = WORKLOAD
    if args.conversations < 1:
        raise CliError("--conversations must be positive")
    worker_args = [
        "--num-blocks",
        str(w.num_blocks),
        "--block-size",
        str(w.block_size),
        "--enable-prefix-caching",
        "--max-model-len",
        str(w.max_model_len),
        "--max-num-seqs",
        str(w.concurrency),
    ]
    print(
        f"starting the allocator, {w.workers} worker(s) on {args.model} (CPU) and the router "
        f"(policy {args.policy}) ...",
        flush=True,
    )
    with LocalStack(
        workers=w.workers,
        model=args.model,
        worker_args=worker_args,
        router=True,
        api_key=True,
        router_args=["--policy", args.policy],
    ) as stack:
        stats, samples, wall = asyncio.run(
            _workload(stack.router_url, stack.api_key, stack.worker_urls, args)
        )
        totals = _worker_totals(stack.worker_urls)
        routing = _routing(stack.router_url, args.policy)
    out_dir = Path(args.out)
    chart = out_dir / "demo_kv.png"
    _chart(chart, samples, w.block_size)
    report = _report(w, stats, samples, wall, totals)
    report["routing"] = routing
    report["chart"] = str(chart)
    (out_dir / "demo_report.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 1 if stats.errors else 0


def _report(
    w: Workload, stats: Stats, samples: list[dict], wall: float, totals: dict[str, float]
) -> dict:
    B = w.block_size
    pool_tokens = w.num_blocks * B * w.workers
    busy = [s for s in samples if s.get("kv_blocks_used", 0) > 0]
    peak_blocks = int(totals.get("pagedkv_worker_kv_blocks_used_peak", 0))
    queried = totals.get("pagedkv_worker_prefix_cache_queried_tokens_total", 0)
    hit = totals.get("pagedkv_worker_prefix_cache_hit_tokens_total", 0)
    ttft = sorted(stats.ttft)
    return {
        "requests": stats.requests,
        "errors": len(stats.errors),
        "wall_seconds": round(wall, 2),
        "requests_per_second": round(stats.requests / wall, 3),
        "completion_tokens": stats.completion_tokens,
        "tokens_per_second": round(stats.completion_tokens / wall, 1),
        "ttft_p50_seconds": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_p95_seconds": round(ttft[int(0.95 * (len(ttft) - 1))], 3) if ttft else None,
        "prefix_cache_hit_rate": round(hit / queried, 3) if queried else 0.0,
        "cached_prompt_tokens": stats.cached_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "preemptions": int(totals.get("pagedkv_worker_preemptions_total", 0)),
        "peak_blocks_used": peak_blocks,
        "peak_slots_allocated": peak_blocks * B,
        "peak_slots_holding_tokens": int(
            totals.get("pagedkv_worker_kv_slots_holding_tokens_peak", 0)
        ),
        "mean_slot_utilisation": round(
            statistics.mean(s["kv_slot_utilisation_ratio"] for s in busy), 4
        )
        if busy
        else None,
        "peak_running_conversations": int(totals.get("pagedkv_worker_running_sequences_peak", 0)),
        "pool_tokens": pool_tokens,
        "reserve_max_conversations_fit": pool_tokens // w.max_model_len,
        "max_model_len": w.max_model_len,
        "error_samples": stats.errors[:3],
    }


def _print_report(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="PagedKV demo", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    rows = [
        ("requests (errors)", f"{r['requests']} ({r['errors']})"),
        ("requests / s", f"{r['requests_per_second']:.2f}"),
        ("generated tokens / s", f"{r['tokens_per_second']:.1f}"),
        ("time to first token p50 / p95", f"{r['ttft_p50_seconds']} s / {r['ttft_p95_seconds']} s"),
        ("prefix-cache hit rate (prompt tokens)", f"{r['prefix_cache_hit_rate']:.1%}"),
        ("preemptions", str(r["preemptions"])),
        (
            "KV slots at peak: holding tokens / allocated",
            f"{r['peak_slots_holding_tokens']:,} / {r['peak_slots_allocated']:,}",
        ),
        ("mean slot utilisation while busy", f"{(r['mean_slot_utilisation'] or 0):.1%}"),
        ("conversations running at once (peak)", str(r["peak_running_conversations"])),
        (
            f"reserve-the-maximum ({r['max_model_len']:,} tokens each) would fit",
            f"{r['reserve_max_conversations_fit']} in {r['pool_tokens']:,} slots",
        ),
        ("chart", r["chart"]),
    ]
    g = r.get("routing")
    if g:
        rows[-1:-1] = [
            (
                f"router ({g['policy']}): requests per worker",
                ", ".join(f"{w} {n}" for w, n in g["requests_per_worker"].items()),
            ),
            (
                "router: prefix tokens cached where sent / best any worker had",
                f"{g['prefix_tokens_cached_where_sent']:,} / "
                f"{g['prefix_tokens_cached_best_worker']:,}",
            ),
            (
                "router: routing time (mean) / retries",
                f"{g['routing_ms_mean']} ms / {g['retries']}",
            ),
        ]
    for a, b in rows:
        t.add_row(a, b)
    Console(width=110).print(t)
