"""`pagedkv bench pd`: prefill/decode disaggregation against the same two devices colocated.

Systems (`SYSTEMS`), each two workers behind the router (`pagedkv.stack.LocalStack`, real
processes, the allocator service, credentials): `colocated` (both workers `--kv-role both`: each
prefills and decodes its own requests) and `pd` (one `--kv-role prefill`, one `--kv-role
decode`, the allocator holding a file:// shared store: the router sends a request's prompt to
the prefill worker, then the request to the decode worker, whose admission loads the prompt's
blocks from the store). They run one after the other, each on fresh processes. On `sim:` the
store holds twice the stream's KV bytes (only the allocator's index: a simulated worker writes
no bytes), so its LRU drops no prompt before the decode worker loads it.

Workload (`workloads.PD`, `chats_and_documents`): one request stream, seeded, arriving as a
Poisson process: chats (prompts of 200-1,000 tokens) mixed with long documents (4,000-8,000),
token-id prompts, greedy, a fixed number of output tokens (EOS ignored), streamed through
`/v1/completions` with `return_token_ids`. The default runs Llama-3-8B's public config on
`sim:h100` (docs/simulator.md) with the wall clock: steps take their roofline time, the host's
own work shows against it, and every figure is the simulated device's. `--workload cpu` runs
real CPU workers (`--model tiny-random` by default, or `smollm2`) on a few short requests: the
outputs and the bytes moved are the point there, not the times.

Figures per system, from the client's clock: TTFT (sent -> first token), ITL (the gaps between
streamed chunks, a chunk of k tokens counting its gap / k, k times), TPOT ((last token - first
token) / (tokens - 1)), tokens/s (generated tokens / the run's wall time) and goodput (requests
with TTFT <= 2 s and TPOT <= 50 ms, per second of the run). From the workers' /metrics: the
bytes the KV tiers saved and loaded (the shared store's, per request); from the router's: the
split requests' prefill leg and their transfer (the wait after the prefill leg until the decode
worker finds the prompt's blocks) per request, and what each transfer became.

Targets (`TARGETS`): pd's ITL p99 <= 0.5x colocated's; pd's goodput >= 1.3x colocated's; every
request's greedy token ids identical between the systems (on `sim:` the ids are the
simulator's, a function of the sequence: compared all the same). Not a timed test: the figures
are compared within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from typing import Any

from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell, verdict
from pagedkv.bench.workloads import PD, PDWorkload, chats_and_documents

SYSTEMS = ("colocated", "pd")
ROLES = {"colocated": (), "pd": ("prefill", "decode")}
TARGETS = {"itl_p99_ratio": 0.5, "goodput_ratio": 1.3}
PD_OUTCOMES = ("transferred", "incomplete", "prefill_failed")
STORE_GIB = 4.0  # the shared store of real workers (their prompts are short)


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_workload_option(p, PD)
    p.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="the workers' model: on a sim: device a public config (llama-3-8b, opt-13b), on "
        "cpu a model (tiny-random, smollm2, a path) [the workload's]",
    )
    harness.add_json_option(p)


# -- one system -------------------------------------------------------------------------------


def _stack(system: str, model: str, w: PDWorkload, store_gib: float):
    from pagedkv.stack import LocalStack

    return LocalStack(
        workers=2,
        model=model,
        kv_roles=ROLES[system],
        shared_store_gib=store_gib,
        worker_args=[
            "--device",
            w.device,
            "--log-level",
            "warning",
            "--max-num-seqs",
            str(w.max_num_seqs),
        ],
        router=True,
        router_args=["--log-level", "warning"],
        startup_timeout=300,
    )


async def _one(client, url: str, model: str, prompt: list[int], w: PDWorkload) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": w.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ids: list[int] = []
    stamps: list[tuple[float, int]] = []  # (seconds after sending, tokens in the chunk)
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {(await r.aread())[:200]!r}"}
        worker = r.headers.get("x-pagedkv-worker")
        prefill_worker = r.headers.get("x-pagedkv-prefill-worker")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"].get("message", "")}
            new = [t for c in chunk.get("choices") or () for t in c.get("token_ids") or ()]
            if new:
                stamps.append((time.perf_counter() - t0, len(new)))
                ids += new
            usage = chunk.get("usage") or usage
    if not stamps:
        return {"error": "no token streamed"}
    itl = []
    for (before, _), (at, k) in zip(stamps, stamps[1:], strict=False):
        itl += [(at - before) / k] * k
    ttft, last = stamps[0][0], stamps[-1][0]
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft,
        "tpot_s": (last - ttft) / (len(ids) - 1) if len(ids) > 1 else None,
        "itl_s": itl,
        "end_s": last,
        "token_ids": ids,
        "prompt_tokens": len(prompt),
        "cached_tokens": details.get("cached_tokens"),
        "worker": worker,
        "prefill_worker": prefill_worker,
    }


async def _stream(url: str, model: str, requests: list[tuple[float, list[int]]], w: PDWorkload):
    """Every request sent at its arrival time; (results in request order, the run's wall time)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()

        async def at(when: float, prompt: list[int]) -> dict:
            await asyncio.sleep(max(0.0, t0 + when - time.perf_counter()))
            sent = time.perf_counter() - t0
            try:
                got = await _one(client, url, model, prompt, w)
            except httpx.HTTPError as exc:
                got = {"error": f"{type(exc).__name__}: {exc}"}
            return {"sent_s": sent, **got}

        results = await asyncio.gather(*(at(when, prompt) for when, prompt in requests))
        return results, time.perf_counter() - t0


def _router_pd(url: str) -> dict[str, float]:
    """The router's P/D counters so far: each outcome's count, and the legs' sums and counts."""
    got: dict[str, float] = {}
    for s in harness.metric_samples(url):
        if s.name == "pagedkv_router_pd_requests_total":
            got[s.labels.get("outcome", "")] = s.value
        elif s.name.startswith(
            ("pagedkv_router_pd_prefill_seconds_", "pagedkv_router_pd_transfer")
        ):
            if s.name.endswith(("_sum", "_count")):
                got[s.name] = s.value
    return got


def _one_run(system: str, model: str, requests, w: PDWorkload, store_gib: float) -> dict:
    with _stack(system, model, w, store_gib) as stack:
        names = [worker.worker_id for worker in stack.workers]
        before = [harness.tier_bytes([url]) for url in stack.worker_urls]
        router_before = _router_pd(stack.router_url)
        results, wall = asyncio.run(_stream(stack.router_url, model, requests, w))
        by_worker = {
            name: {k: v - was.get(k, 0.0) for k, v in harness.tier_bytes([url]).items()}
            for name, url, was in zip(names, stack.worker_urls, before, strict=True)
        }
        router = {k: v - router_before.get(k, 0.0) for k, v in _router_pd(stack.router_url).items()}
    return _figures(results, wall, by_worker, router, w)


# -- figures ----------------------------------------------------------------------------------


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 2)


def _figures(results, wall: float, by_worker: dict, router: dict, w: PDWorkload) -> dict[str, Any]:
    """A run's figures; `by_worker`: each worker's tier bytes over the run ("saved:TIER", ...)."""
    tiers: dict[str, float] = {}
    for got in by_worker.values():
        for k, v in got.items():
            tiers[k] = tiers.get(k, 0.0) + v
    ok = [r for r in results if "error" not in r]
    n = len(results)
    itl = [g for r in ok for g in r["itl_s"]]
    good = [
        r
        for r in ok
        if r["ttft_s"] <= w.ttft_slo_s and r["tpot_s"] is not None and r["tpot_s"] <= w.tpot_slo_s
    ]
    tokens = sum(len(r["token_ids"]) for r in ok)
    saved = [v for k, v in tiers.items() if k.startswith("saved:")]
    loaded = [v for k, v in tiers.items() if k.startswith("loaded:")]

    def per_request(values: list[float]) -> int | None:
        return round(sum(values) / n) if values and n else None

    def leg(name: str) -> float | None:
        count = router.get(f"pagedkv_router_pd_{name}_seconds_count")
        total = router.get(f"pagedkv_router_pd_{name}_seconds_sum")
        return round(total / count, 4) if count and total is not None else None

    split = sum(router.get(o, 0.0) for o in PD_OUTCOMES)
    cached = [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None]
    return {
        "requests": n,
        "errors": n - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "ttft_p50_s": _round(harness.percentile((r["ttft_s"] for r in ok), 0.5), 4),
        "ttft_p99_s": _round(harness.percentile((r["ttft_s"] for r in ok), 0.99), 4),
        "itl_p50_ms": _ms(harness.percentile(itl, 0.5)),
        "itl_p99_ms": _ms(harness.percentile(itl, 0.99)),
        "tpot_p50_ms": _ms(harness.percentile((r["tpot_s"] for r in ok), 0.5)),
        "tpot_p99_ms": _ms(harness.percentile((r["tpot_s"] for r in ok), 0.99)),
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "goodput_rps": round(len(good) / wall, 4) if wall > 0 else None,
        "slo_met": len(good),
        "wall_s": round(wall, 3),
        # None: no worker exports the tiers' bytes (it has no tier below its pool)
        "bytes_moved_per_request": per_request(saved + loaded),
        "bytes_saved_per_request": per_request(saved),
        "bytes_loaded_per_request": per_request(loaded),
        # each worker's, in all: who saved and who loaded them
        "bytes_by_worker": {
            name: {k: round(v) for k, v in sorted(got.items())} for name, got in by_worker.items()
        },
        "split_requests": round(split) if router else None,
        "transfers": {o: round(router[o]) for o in PD_OUTCOMES if o in router} or None,
        "prefill_leg_s_per_request": leg("prefill"),
        "transfer_s_per_request": leg("transfer_wait"),
        "cached_tokens_per_request": round(sum(cached) / len(cached), 1) if cached else None,
        "prefill_workers": sorted({r["prefill_worker"] for r in ok if r["prefill_worker"]}),
        "answering_workers": sorted({r["worker"] for r in ok if r["worker"]}),
        "_token_ids": [r.get("token_ids") for r in results],
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _targets(summary: dict[str, dict]) -> dict[str, Any]:
    co, pd = summary.get("colocated", {}), summary.get("pd", {})
    itl = harness.ratio(pd.get("itl_p99_ms"), co.get("itl_p99_ms"))
    goodput = harness.ratio(pd.get("goodput_rps"), co.get("goodput_rps"))
    a, b = co.get("_token_ids"), pd.get("_token_ids")
    differ = compared = None
    if a is not None and b is not None:  # the same requests, in the same order
        both = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
        compared, differ = len(both), sum(x != y for x, y in both)
    return {
        "itl_p99_ratio": itl,
        "itl_p99_ratio_target": TARGETS["itl_p99_ratio"],
        "itl_p99_ratio_met": None if itl is None else itl <= TARGETS["itl_p99_ratio"],
        "goodput_ratio": goodput,
        "goodput_ratio_target": TARGETS["goodput_ratio"],
        "goodput_ratio_met": None if goodput is None else goodput >= TARGETS["goodput_ratio"],
        "outputs_compared": compared,  # the requests both systems answered
        "outputs_differing": differ,
        "outputs_identical": None if not compared else differ == 0,
    }


def _store_gib(requests, w: PDWorkload, kv_bytes_per_token: int | None) -> float:
    """The shared store's size: twice every token of the stream (prompts and outputs), so that
    its LRU drops no prompt before the decode worker loads it (a simulated store holds no bytes:
    only the allocator's index); on real workers `pagedkv up`'s default."""
    if kv_bytes_per_token is None:
        return STORE_GIB
    tokens = sum(len(prompt) + w.output_tokens for _, prompt in requests)
    return float(math.ceil(2 * tokens * kv_bytes_per_token / 2**30))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    w = PD[args.workload]
    requests = chats_and_documents(w)
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-pd-") as folder:
        model = args.model or w.model
        label, kv_bytes_per_token = model, None
        if w.device.startswith("sim:"):
            from worker.sim import PUBLIC_CONFIGS, write_config
            from worker.sim.shape import ModelShape

            if model not in PUBLIC_CONFIGS:
                from pagedkv_base.settings import CliError

                raise CliError(
                    f"--model on {w.device}: one of {', '.join(PUBLIC_CONFIGS)}, not {model!r}"
                )
            kv_bytes_per_token = ModelShape.from_config(PUBLIC_CONFIGS[model]).kv_bytes_per_token
            model = str(write_config(model, folder))
            label = f"{label} (public config.json)"
        store_gib = _store_gib(requests, w, kv_bytes_per_token)
        summary = {}
        for system in SYSTEMS:
            harness.log("pd", f"{system}: {w.requests} requests at {w.rate_rps:g} requests/s")
            summary[system] = _one_run(system, model, requests, w, store_gib)
    targets = _targets(summary)
    for figures in summary.values():
        del figures["_token_ids"]
    lengths = [len(p) for _, p in requests]
    return {
        "device": w.device,
        "clock": "wall",
        "model": label,
        "kv_bytes_per_token": kv_bytes_per_token,  # None: not computed here (a real model)
        "shared_store_gib": store_gib,
        "workload": w.what,
        "stream": {
            "requests": w.requests,
            "rate_rps": w.rate_rps,
            "documents": sum(n >= w.document_tokens[0] for n in lengths),
            "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1),
            "prompt_tokens_max": max(lengths),
            "output_tokens": w.output_tokens,
            "seed": w.seed,
        },
        "slo": {"ttft_s": w.ttft_slo_s, "tpot_s": w.tpot_slo_s},
        "summary": summary,
        "targets": targets,
    }


# -- tables -----------------------------------------------------------------------------------

COLUMNS = (
    ("system", None, ""),
    ("TTFT p50 s", "ttft_p50_s", ".3f"),
    ("TTFT p99 s", "ttft_p99_s", ".3f"),
    ("ITL p50 ms", "itl_p50_ms", ".2f"),
    ("ITL p99 ms", "itl_p99_ms", ".2f"),
    ("tokens/s", "tokens_per_s", ".1f"),
    ("goodput req/s", "goodput_rps", ".3f"),
    ("bytes moved / req", "bytes_moved_per_request", ","),
    ("transfer s / req", "transfer_s_per_request", ".4f"),
    ("errors", "errors", ""),
)


def tables(report: dict) -> list[Table]:
    rows = [
        [name, *(cell(s.get(key), spec) for _, key, spec in COLUMNS[1:])]
        for name, s in report["summary"].items()
    ]
    st, slo = report["stream"], report["slo"]
    notes = [
        f"{report['model']} on {report['device']} ({report['clock']} clock): {report['workload']}",
        f"{st['requests']} requests ({st['documents']} long documents), prompts of "
        f"{st['prompt_tokens_mean']:g} tokens on average (at most {st['prompt_tokens_max']}), "
        f"{st['output_tokens']} output tokens each, Poisson arrivals at {st['rate_rps']:g}/s "
        f"(seed {st['seed']}).",
        f"goodput: requests with TTFT <= {slo['ttft_s']:g} s and TPOT <= "
        f"{slo['tpot_s'] * 1000:g} ms, per second of the run; bytes moved: the KV tiers' saved "
        "and loaded bytes (the workers' /metrics); transfer: the router's wait after a split "
        "request's prefill leg until the decode worker finds its blocks.",
    ]
    if not report["device"].startswith("sim:"):
        notes.append(
            "Real workers on this machine's CPU: the outputs and the bytes moved are the point "
            "here; the times are a CPU's, not a GPU's, and the targets on them compare nothing."
        )
    notes.append(
        f"The shared store holds {cell(report.get('shared_store_gib'), 'g')} GiB (pd's allocator)."
    )
    for name, s in report["summary"].items():
        if s.get("bytes_moved_per_request") is None:
            notes.append(
                f"{name}: bytes moved '-': its workers have no tier below their pools (no shared "
                "store, no host tier), so they export no tier bytes; none move between them."
            )
        if s.get("split_requests"):
            notes.append(
                f"{name}: {s['split_requests']} requests split ({s['transfers']}), prefill leg "
                f"{cell(s['prefill_leg_s_per_request'], '.4f')} s per request, "
                f"{cell(s['cached_tokens_per_request'])} cached prompt tokens per request."
            )
        moved = [
            f"{worker} {k.split(':')[0]} {v / s['requests']:,.0f} ({k.split(':')[1]} tier)"
            for worker, got in (s.get("bytes_by_worker") or {}).items()
            for k, v in got.items()
            if v
        ]
        if moved and s["requests"]:
            notes.append(f"{name}: bytes per request, by worker: " + "; ".join(moved) + ".")
        if s.get("first_error"):
            notes.append(f"{name}: first error: {s['first_error']}")
    t = report["targets"]
    target_rows = [
        [
            "ITL p99, pd / colocated",
            cell(t["itl_p99_ratio"], ".3f"),
            f"<= {t['itl_p99_ratio_target']:g}",
            verdict(t["itl_p99_ratio_met"]),
        ],
        [
            "goodput, pd / colocated",
            cell(t["goodput_ratio"], ".3f"),
            f">= {t['goodput_ratio_target']:g}",
            verdict(t["goodput_ratio_met"]),
        ],
        [
            f"requests whose greedy token ids differ (of {cell(t['outputs_compared'])} both "
            "answered)",
            cell(t["outputs_differing"]),
            "0",
            verdict(t["outputs_identical"]),
        ],
    ]
    return [
        Table(
            "P/D disaggregation: 2 colocated workers vs 1 prefill + 1 decode",
            [c for c, _, _ in COLUMNS],
            rows,
            notes,
        ),
        Table("P/D targets", ["figure", "value", "target", "outcome"], target_rows),
    ]


def run(args: argparse.Namespace) -> int:
    return harness.run("pd", args, measure, tables)
