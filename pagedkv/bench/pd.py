"""`pagedkv bench pd`: prefill/decode disaggregation against the same two devices colocated.

Systems (`SYSTEMS`), each two workers behind the router (`pagedkv.stack.LocalStack`, real
processes, the allocator service, credentials): `colocated` (both workers `--kv-role both`: each
prefills and decodes its own requests), `pd` (one `--kv-role prefill`, one `--kv-role decode`,
the allocator holding a file:// shared store: the router sends a request's prompt to the prefill
worker, then the request to the decode worker, whose admission loads the prompt's blocks from
the store) and `pd-peer` (the same two roles on a `peer://` store: no store runs, the decode
worker pulls the blocks from the prefill worker's peer route). They run one after the other,
each on fresh processes. On `sim:` the store holds twice the stream's KV bytes (only the
allocator's index: a simulated worker writes no bytes and pulls none, so `pd` and `pd-peer`
differ there only in the index's bookkeeping), so its LRU drops no prompt before the decode
worker loads it.

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
with TTFT <= 2 s and TPOT <= 50 ms, per second of the run), and how many requests missed each
bound. From the workers' /metrics: the bytes the KV tiers saved and loaded (the shared store's,
per request), and each worker's device utilization (its busy seconds over the run's wall time)
and mean queue time (arrival -> first scheduled) and prefill time (first scheduled -> first
token); from the router's: the split requests' prefill leg and their transfer (the wait after
the prefill leg until the decode worker finds the prompt's blocks) per request, what each
transfer became, the time to choose a worker and the MatchPrefix calls per request; from the
processes themselves, each one's CPU seconds per request. On `sim:`, the report also gives what
a prompt of the stream costs the prefill device on average (its roofline compute alone, in
chunks of the worker's token budget, and its store saves over the host link): the rate at which
one prefill device is full.

`--rates LIST` sweeps instead: each system on one set of fresh processes takes a stream at each
rate in turn, lowest first (`--requests` requests each, their prompts drawn anew per rate, so no
rate finds another's blocks cached), and the report gives each rate's goodput and SLO
attainment (the share of requests meeting both bounds) per system, and each system's capacity:
the highest rate swept at which at least 90% of the requests met both (DistServe's measure).

Targets (`TARGETS`): pd's ITL p99 <= 0.5x colocated's; pd's goodput >= 1.3x colocated's; every
request's greedy token ids identical between the systems (`pd-peer`'s ratios and outputs against
colocated's are reported beside pd's, under `targets["pd-peer"]`) (on `sim:` the ids are the
simulator's, a function of the sequence: compared all the same). Not a timed test: the figures
are compared within one run.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import replace
from typing import Any

from pagedkv.bench import harness
from pagedkv.bench.pd_stream import send
from pagedkv.bench.pd_tables import tables
from pagedkv.bench.workloads import PD, PDWorkload, chats_and_documents

SYSTEMS = ("colocated", "pd", "pd-peer")
ROLES = {"colocated": (), "pd": ("prefill", "decode"), "pd-peer": ("prefill", "decode")}
STORES = {"pd-peer": "peer://"}  # the others: the stack's own (file://, for a P/D fleet)
SPLIT = ("pd", "pd-peer")
TARGETS = {"itl_p99_ratio": 0.5, "goodput_ratio": 1.3}
ATTAINMENT = 0.9  # a swept rate is within a system's capacity when this share meets both SLOs
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
    p.add_argument(
        "--requests",
        type=harness.positive,
        default=None,
        metavar="N",
        help="requests per stream (with --rates, per rate) [the workload's]",
    )
    p.add_argument(
        "--rates",
        type=harness.comma_list(low=1),
        default=None,
        metavar="LIST",
        help="sweep these arrival rates (requests/s) instead: goodput and SLO attainment per "
        "rate and system, and each system's capacity (the highest rate at which >= 90%% of "
        "the requests meet both SLOs)",
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
        allocator_args=(
            ["--kv-shared-store", STORES[system], "--kv-shared-store-size", f"{store_gib:g}"]
            if system in STORES
            else []
        ),
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


def _against(co: dict, other: dict) -> dict[str, Any]:
    """`other`'s ITL p99 and goodput over colocated's, and whether every request both answered
    got the same greedy token ids."""
    itl = harness.ratio(other.get("itl_p99_ms"), co.get("itl_p99_ms"))
    goodput = harness.ratio(other.get("goodput_rps"), co.get("goodput_rps"))
    a, b = co.get("_token_ids"), other.get("_token_ids")
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


def _targets(summary: dict[str, dict]) -> dict[str, Any]:
    co = summary.get("colocated", {})
    out = _against(co, summary.get("pd", {}))
    if "pd-peer" in summary:
        out["pd-peer"] = _against(co, summary["pd-peer"])
    return out


def _store_gib(requests, w: PDWorkload, kv_bytes_per_token: int | None) -> float:
    """The shared store's size: twice every token of the stream (prompts and outputs), so that
    its LRU drops no prompt before the decode worker loads it (a simulated store holds no bytes:
    only the allocator's index); on real workers `pagedkv up`'s default."""
    if kv_bytes_per_token is None:
        return STORE_GIB
    tokens = sum(len(prompt) + w.output_tokens for _, prompt in requests)
    return float(math.ceil(2 * tokens * kv_bytes_per_token / 2**30))


def _model(w: PDWorkload, name: str | None, folder: str) -> tuple[str, str, int | None]:
    """(the workers' --model, its label, its KV bytes per token: None for a real model)."""
    model = name or w.model
    if not w.device.startswith("sim:"):
        return model, model, None
    from worker.sim import PUBLIC_CONFIGS, write_config
    from worker.sim.shape import ModelShape

    if model not in PUBLIC_CONFIGS:
        from pagedkv_base.settings import CliError

        raise CliError(f"--model on {w.device}: one of {', '.join(PUBLIC_CONFIGS)}, not {model!r}")
    kv_bytes_per_token = ModelShape.from_config(PUBLIC_CONFIGS[model]).kv_bytes_per_token
    return str(write_config(model, folder)), f"{model} (public config.json)", kv_bytes_per_token


def _prefill_device_s(w: PDWorkload, model: str, requests) -> dict[str, float] | None:
    """On `sim:`, what one request's prompt costs the prefill worker's device, on average:
    its roofline time computed alone in chunks of the worker's token budget (`compute_s`), and
    its whole blocks' store saves over the host link (`saves_s`). Times a rate, the share of a
    prefill device the stream needs. None on real workers."""
    if not w.device.startswith("sim:"):
        return None
    from worker.engine.config import EngineConfig
    from worker.sim import PUBLIC_CONFIGS, Roofline, gpu
    from worker.sim.shape import ModelShape

    config = EngineConfig()
    shape = ModelShape.from_config(PUBLIC_CONFIGS[model])
    roofline = Roofline(gpu(w.device.removeprefix("sim:")), shape)
    budget, block = config.max_num_batched_tokens, config.block_size
    compute = saves = 0.0
    for _, prompt in requests:
        n = len(prompt)
        for done in range(0, n, budget):
            new = min(budget, n - done)
            compute += roofline.step([(done, new, 1 if done + new == n else 0)]).seconds
        saves += roofline.host_seconds(n // block * block * shape.kv_bytes_per_token)
    return {
        "compute_s": round(compute / len(requests), 5),
        "saves_s": round(saves / len(requests), 5),
    }


def _streams(w: PDWorkload, n: int, rates: list[int] | None) -> list[tuple[PDWorkload, list]]:
    """(the workload at its rate, its requests) per stream: the workload's own, or one per swept
    rate, lowest first, each drawn from a seed of its own."""
    if rates is None:
        w = replace(w, requests=n)
        return [(w, chats_and_documents(w))]
    out = []
    for i, rate in enumerate(sorted(rates)):
        at = replace(w, requests=n, rate_rps=float(rate), seed=w.seed + 1000 * (i + 1))
        out.append((at, chats_and_documents(at)))
    return out


def _runs(model: str, streams, w: PDWorkload, store_gib: float) -> dict[str, list[dict]]:
    """Each system's figures per stream, the streams sent in turn to one set of its processes;
    each stream's outputs compared with colocated's (`outputs_differing`)."""
    out: dict[str, list[dict]] = {}
    for system in SYSTEMS:
        with _stack(system, model, w, store_gib) as stack:
            out[system] = []
            for at, requests in streams:
                harness.log("pd", f"{system}: {at.requests} requests at {at.rate_rps:g} requests/s")
                out[system].append(send(stack, model, requests, at))
    return out


def _capacity(points: list[dict]) -> float | None:
    """The highest swept rate at which >= ATTAINMENT of the requests met both SLOs, error-free."""
    return max(
        (
            p["rate_rps"]
            for p in points
            if p["slo_attainment"] is not None
            and p["slo_attainment"] >= ATTAINMENT
            and not p["errors"]
        ),
        default=None,
    )


def _sweep(runs: dict[str, list[dict]], streams) -> dict[str, Any]:
    systems: dict[str, list[dict]] = {}
    for system, figures in runs.items():
        systems[system] = []
        for i, ((at, _), f) in enumerate(zip(streams, figures, strict=True)):
            compared = None if system == "colocated" else _against(runs["colocated"][i], f)
            point = {"rate_rps": at.rate_rps, **f}
            point["outputs_differing"] = compared and compared["outputs_differing"]
            systems[system].append(point)
    for points in systems.values():
        for p in points:
            del p["_token_ids"], p["bytes_by_worker"]
    return {
        "rates": [at.rate_rps for at, _ in streams],
        "requests_per_rate": streams[0][0].requests,
        "attainment": ATTAINMENT,
        "systems": systems,
        "capacity_rps": {system: _capacity(points) for system, points in systems.items()},
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    w = PD[args.workload]
    streams = _streams(w, args.requests or w.requests, args.rates)
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-pd-") as folder:
        model, label, kv_bytes_per_token = _model(w, args.model, folder)
        every = [r for _, requests in streams for r in requests]
        store_gib = _store_gib(every, w, kv_bytes_per_token)
        runs = _runs(model, streams, w, store_gib)
    lengths = [len(p) for _, p in every]
    report: dict[str, Any] = {
        "device": w.device,
        "clock": "wall",
        "model": label,
        "kv_bytes_per_token": kv_bytes_per_token,  # None: not computed here (a real model)
        "shared_store_gib": store_gib,
        "workload": w.what,
        "stream": {
            "requests": streams[0][0].requests,  # per stream
            "streams": len(streams),
            # a sweep's rates are in report["sweep"]
            "rate_rps": None if args.rates else w.rate_rps,
            "documents": sum(n >= w.document_tokens[0] for n in lengths),  # in all streams
            "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1),
            "prompt_tokens_max": max(lengths),
            "output_tokens": w.output_tokens,
            "seed": w.seed,
            "prefill_device_s_per_request": _prefill_device_s(w, args.model or w.model, every),
        },
        "slo": {"ttft_s": w.ttft_slo_s, "tpot_s": w.tpot_slo_s},
    }
    if args.rates:
        report["sweep"] = _sweep(runs, streams)
        return report
    summary = {system: figures[0] for system, figures in runs.items()}
    targets = _targets(summary)
    for figures in summary.values():
        del figures["_token_ids"]
    report["summary"], report["targets"] = summary, targets
    return report


def run(args: argparse.Namespace) -> int:
    return harness.run("pd", args, measure, tables)
