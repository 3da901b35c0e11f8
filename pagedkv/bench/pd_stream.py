"""`bench pd`'s client and figures: one request stream sent through the router, and what a run
measured (the client's clock, the router's and the workers' /metrics); `pagedkv.bench.pd` says
what every figure means."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pagedkv.bench import harness
from pagedkv.bench.workloads import PDWorkload

PD_OUTCOMES = ("transferred", "incomplete", "prefill_failed")
# the workers' series a run reads before and after its stream: the device's busy seconds and
# the request histograms' sums and counts (requests that finished by themselves)
_WORKER_SERIES = (
    "pagedkv_worker_device_busy_seconds",
    "pagedkv_worker_request_queue_time_seconds_sum",
    "pagedkv_worker_request_queue_time_seconds_count",
    "pagedkv_worker_request_prefill_time_seconds_sum",
    "pagedkv_worker_request_prefill_time_seconds_count",
)

# the host time the worker's steps waited for their allocator calls (what async scheduling did
# not hide: the device waits meanwhile)
_WAIT = "pagedkv_worker_step_host_seconds_sum"


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
            if (chunk := harness.sse_chunk(line)) is None:
                continue
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
    """The router's P/D counters so far: each outcome's count, and the legs' and the routing
    decisions' sums and counts."""
    got: dict[str, float] = {}
    for s in harness.metric_samples(url):
        if s.name == "pagedkv_router_pd_requests_total":
            got[s.labels.get("outcome", "")] = s.value
        elif s.name.startswith(
            (
                "pagedkv_router_pd_prefill_seconds_",
                "pagedkv_router_pd_transfer",
                "pagedkv_router_routing_seconds_",
                "pagedkv_router_match_prefix_seconds_",
            )
        ):
            if s.name.endswith(("_sum", "_count")):
                got[s.name] = got.get(s.name, 0.0) + s.value  # (routing: every policy's)
    return got


def _worker_series(url: str) -> dict[str, float]:
    """A worker's tier bytes ("saved:TIER", ...) and `_WORKER_SERIES` so far."""
    got = harness.tier_bytes([url])
    for s in harness.metric_samples(url):
        if s.name in _WORKER_SERIES:
            got[s.name] = got.get(s.name, 0.0) + s.value
        elif s.name == _WAIT and s.labels.get("part") == "allocator_wait":
            got[_WAIT] = got.get(_WAIT, 0.0) + s.value
    return got


def _cpu_seconds(stack) -> dict[str, float]:
    """The CPU seconds (user and system) each of `stack`'s processes has used so far."""
    import psutil

    processes = {"allocator": stack.allocator, "router": stack.router}
    processes |= {worker.worker_id: worker for worker in stack.workers}
    return {name: sum(psutil.Process(p.pid).cpu_times()[:2]) for name, p in processes.items()}


def send(stack, model: str, requests, w: PDWorkload) -> dict[str, Any]:
    """`requests` sent through `stack`'s router at their arrival times; the run's figures
    (`figures`): what changed on the router's and the workers' /metrics over it included, and
    the CPU seconds its processes used per request."""
    names = [worker.worker_id for worker in stack.workers]
    before = [_worker_series(url) for url in stack.worker_urls]
    router_before = _router_pd(stack.router_url)
    cpu_before = _cpu_seconds(stack)
    results, wall = asyncio.run(_stream(stack.router_url, model, requests, w))
    cpu = {k: v - cpu_before[k] for k, v in _cpu_seconds(stack).items()}
    by_worker = {
        name: {k: v - was.get(k, 0.0) for k, v in _worker_series(url).items()}
        for name, url, was in zip(names, stack.worker_urls, before, strict=True)
    }
    router = {k: v - router_before.get(k, 0.0) for k, v in _router_pd(stack.router_url).items()}
    roles = {worker.worker_id: _role(worker.args) for worker in stack.workers}
    got = figures(results, wall, by_worker, router, w, roles)
    got["cpu_s_per_request"] = {k: round(v / len(requests), 5) for k, v in cpu.items()}
    return got


def _role(args: list[str]) -> str:
    return args[args.index("--kv-role") + 1] if "--kv-role" in args else "both"


# -- figures ----------------------------------------------------------------------------------


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 2)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _per(got: dict[str, float], name: str) -> float | None:
    """A worker histogram's mean over the run (None: no observation)."""
    count = got.get(f"{name}_count")
    return round(got[f"{name}_sum"] / count, 4) if count else None


def _workers(by_worker: dict, roles: dict[str, str], wall: float) -> dict[str, dict]:
    """Each worker's role, device utilization (busy seconds / the run's wall time), the share
    of the run its steps waited for the allocator, and mean queue (arrival -> first scheduled)
    and prefill (first scheduled -> first token) time."""
    out = {}
    for name, got in by_worker.items():
        busy, wait = got.get("pagedkv_worker_device_busy_seconds"), got.get(_WAIT)
        out[name] = {
            "role": roles.get(name),
            "device_busy": round(busy / wall, 4) if busy is not None and wall > 0 else None,
            "allocator_wait": round(wait / wall, 4) if wait is not None and wall > 0 else None,
            "queue_s_per_request": _per(got, "pagedkv_worker_request_queue_time_seconds"),
            "prefill_s_per_request": _per(got, "pagedkv_worker_request_prefill_time_seconds"),
            "requests": round(got.get("pagedkv_worker_request_queue_time_seconds_count", 0)),
        }
    return out


def figures(
    results, wall: float, by_worker: dict, router: dict, w: PDWorkload, roles: dict[str, str]
) -> dict[str, Any]:
    """A run's figures; `by_worker`: each worker's series over the run (`_worker_series`)."""
    tiers: dict[str, float] = {}
    for got in by_worker.values():
        for k, v in got.items():
            if k.startswith(("saved:", "loaded:")):
                tiers[k] = tiers.get(k, 0.0) + v
    ok = [r for r in results if "error" not in r]
    n = len(results)
    itl = [g for r in ok for g in r["itl_s"]]
    ttft_ok = [r for r in ok if r["ttft_s"] <= w.ttft_slo_s]
    tpot_ok = [r for r in ok if r["tpot_s"] is not None and r["tpot_s"] <= w.tpot_slo_s]
    good = [r for r in ttft_ok if r["tpot_s"] is not None and r["tpot_s"] <= w.tpot_slo_s]
    tokens = sum(len(r["token_ids"]) for r in ok)
    saved = [v for k, v in tiers.items() if k.startswith("saved:")]
    loaded = [v for k, v in tiers.items() if k.startswith("loaded:")]

    def per_request(values: list[float]) -> int | None:
        return round(sum(values) / n) if values and n else None

    def leg(name: str) -> float | None:
        count = router.get(f"pagedkv_router_{name}_seconds_count")
        total = router.get(f"pagedkv_router_{name}_seconds_sum")
        return round(total / count, 4) if count and total is not None else None

    split = sum(router.get(o, 0.0) for o in PD_OUTCOMES)
    cached = [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None]
    return {
        "requests": n,
        "errors": n - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "ttft_mean_s": _round(harness.mean(r["ttft_s"] for r in ok), 4),
        "ttft_p50_s": _round(harness.percentile((r["ttft_s"] for r in ok), 0.5), 4),
        "ttft_p99_s": _round(harness.percentile((r["ttft_s"] for r in ok), 0.99), 4),
        "itl_p50_ms": _ms(harness.percentile(itl, 0.5)),
        "itl_p99_ms": _ms(harness.percentile(itl, 0.99)),
        "tpot_p50_ms": _ms(harness.percentile((r["tpot_s"] for r in ok), 0.5)),
        "tpot_p99_ms": _ms(harness.percentile((r["tpot_s"] for r in ok), 0.99)),
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "goodput_rps": round(len(good) / wall, 4) if wall > 0 else None,
        "slo_met": len(good),
        "slo_attainment": round(len(good) / n, 4) if n else None,
        # answered requests over each bound (a request may miss both)
        "ttft_missed": len(ok) - len(ttft_ok),
        "tpot_missed": len(ok) - len(tpot_ok),
        "wall_s": round(wall, 3),
        # None: no worker exports the tiers' bytes (it has no tier below its pool)
        "bytes_moved_per_request": per_request(saved + loaded),
        "bytes_saved_per_request": per_request(saved),
        "bytes_loaded_per_request": per_request(loaded),
        # each worker's, in all: who saved and who loaded them
        "bytes_by_worker": {
            name: {
                k: round(v) for k, v in sorted(got.items()) if k.startswith(("saved:", "loaded:"))
            }
            for name, got in by_worker.items()
        },
        "workers": _workers(by_worker, roles, wall),
        "split_requests": round(split) if router else None,
        "transfers": {o: round(router[o]) for o in PD_OUTCOMES if o in router} or None,
        "prefill_leg_s_per_request": leg("pd_prefill"),
        "transfer_s_per_request": leg("pd_transfer_wait"),
        # choosing a worker (tokenize, match, rank), per choice: a split request makes two
        "routing_s_per_choice": leg("routing"),
        # MatchPrefix calls to the allocator (routing and the transfer's wait), per request
        "match_prefix_calls_per_request": (
            round(router["pagedkv_router_match_prefix_seconds_count"] / n, 2)
            if n and "pagedkv_router_match_prefix_seconds_count" in router
            else None
        ),
        "cached_tokens_per_request": round(sum(cached) / len(cached), 1) if cached else None,
        "prefill_workers": sorted({r["prefill_worker"] for r in ok if r["prefill_worker"]}),
        "answering_workers": sorted({r["worker"] for r in ok if r["worker"]}),
        "_token_ids": [r.get("token_ids") for r in results],
    }
