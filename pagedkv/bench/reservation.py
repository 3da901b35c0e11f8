"""`pagedkv bench reservation`: paging against reserving each request's KV memory up front.

The reference article's claim (the vLLM paper's Figure 12): at the same
latency, paging serves 2-4x the requests per second of servers that reserve
one stretch per request. One engine serves the same requests four ways
(`EngineConfig.kv_reservation`, worker/engine/reservation.py): `paged`
(blocks as a sequence grows), `max` (the context length: FasterTransformer,
Orca (Max)), `pow2` (the next power of two of prompt + output: Orca (Pow2))
and `oracle` (prompt + output exactly: Orca (Oracle)); scheduler, allocator
and preemption are the same for all, and none has a prefix cache.

The model is OPT-13B's public config (fp16, 819,200 KV bytes per token) on
a simulated GPU (`--device`, sim:a100-40gb by default) with the virtual
clock: each step takes its roofline time (worker/sim/), host time is not
counted, so the figures are the simulated device's (labelled so). The KV
pool is what the GPU's memory holds beside the weights.

Workload (`workloads.RESERVATION`): ShareGPT-like lengths
(`sharegpt_like_lengths`), the same requests at every rate, arriving as a
Poisson process (`poisson_arrivals`); outputs ignore EOS, so each request
generates exactly its output length and `oracle` knows it. Per system and
rate:

- normalized latency: the mean over requests of (end-to-end latency /
  output tokens), seconds per token, as the paper defines it; latency from
  the request's arrival to its last token, on the virtual clock;
- KV utilisation: tokens whose K/V is stored / slots of the blocks the
  running requests hold, averaged over the run's device time (the article's
  20.4-38.2% for reserving servers, 96.3% for vLLM); the mean number of
  requests running, and preemptions.

`max_rate_rps`: the highest rate whose normalized latency is under the
workload's bound (`latency_bound_s`: 0.1 s per output token, stated in the
report), with every lower rate under it too; null when none is. A system's
sweep ends at its first rate over the bound: its higher rates are not run
(absent from `runs`, "-" in the tables). Targets: `paged_over_max` >=
2.0 and `paged_over_oracle` >= 1.3 (the paper: 2.7-8x over Orca (Max),
1.7-2.7x over Orca (Oracle) on ShareGPT). `--plot FILE` draws normalized
latency against rate for every system, as the paper's Figure 12 does.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell, verdict
from pagedkv.bench.workloads import (
    RESERVATION,
    ReservationWorkload,
    poisson_arrivals,
    sharegpt_like_lengths,
)
from worker.kv_bytes import KV_CACHE_DTYPES

SYSTEMS = ("paged", "max", "pow2", "oracle")
LABELS = {
    "paged": "paged (as vLLM)",
    "max": "max (Orca (Max), FasterTransformer)",
    "pow2": "pow2 (Orca (Pow2))",
    "oracle": "oracle (Orca (Oracle))",
}
TARGETS = {"paged_over_max": 2.0, "paged_over_oracle": 1.3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_workload_option(parser, RESERVATION)
    parser.add_argument(
        "--device",
        default="sim:a100-40gb",
        metavar="sim:NAME",
        help="the simulated GPU (worker --device) [sim:a100-40gb]",
    )
    parser.add_argument(
        "--clock",
        choices=("virtual", "wall"),
        default="virtual",
        help="the engine's clock: virtual (only device time passes: the run takes what the host "
        "takes) or wall (device time really passes) [virtual]",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=tuple(KV_CACHE_DTYPES),
        default="auto",
        help="the workers' --kv-cache-dtype: fp8 halves the KV bytes, so the simulated memory "
        "holds twice the blocks and a step reads half the KV [auto]",
    )
    parser.add_argument(
        "--systems",
        type=harness.comma_list(SYSTEMS),
        default=list(SYSTEMS),
        help=f"which reservations [{','.join(SYSTEMS)}]",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw normalized latency against rate for every system as a PNG",
    )
    harness.add_json_option(parser)


def measure(args: argparse.Namespace) -> dict:
    from worker.model.sim import load_sim_model
    from worker.sim import is_sim, write_config

    if not is_sim(args.device):
        from pagedkv_base.settings import CliError

        raise CliError(f"--device must be a simulated GPU (sim:NAME), got {args.device!r}")
    w = RESERVATION[args.workload]
    lengths = sharegpt_like_lengths(w.requests, w, random.Random(w.seed))
    # at 1 request/s; scaled per rate
    gaps = poisson_arrivals(w.requests, 1.0, random.Random(w.seed + 1))
    runs: dict[str, list[dict]] = {}
    pool = roofline = None
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-reservation-") as folder:
        write_config(w.model, folder)
        loaded = load_sim_model(folder)
        for system in args.systems:
            runs[system] = []
            for rate in w.rates:
                harness.log("reservation", f"{system} at {rate:g} requests/s")
                engine = _engine(loaded, folder, system, args, w)
                try:
                    pool = pool or _pool(engine)
                    roofline = engine.runner.roofline
                    runs[system].append(
                        {"rate_rps": rate, **_run(engine, lengths, [t / rate for t in gaps])}
                    )
                finally:
                    engine.close()
                if runs[system][-1]["normalized_latency_s"] >= w.latency_bound_s:
                    break  # over the bound: higher rates are not run
    summary = {s: _summary(r, w.latency_bound_s) for s, r in runs.items()}
    paged = summary.get("paged", {}).get("max_rate_rps")
    targets = {}
    for key, target in TARGETS.items():
        other = summary.get(key.removeprefix("paged_over_"), {}).get("max_rate_rps")
        value = harness.ratio(paged, other)
        targets[key] = value
        targets[f"{key}_target"] = target
        targets[f"{key}_met"] = None if value is None else value >= target
    report = {
        "device": args.device,
        "clock": args.clock,
        "model": f"{w.model} (public config.json, {loaded.config.dtype})",
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_bytes_per_token": (
            roofline.model if roofline is not None else loaded.config
        ).kv_bytes_per_token,
        "roofline": None
        if roofline is None
        else {
            "gpu": roofline.gpu.description,
            "mfu": roofline.mfu,
            "mbu": roofline.mbu,
            "launch_ms": roofline.launch_s * 1e3,
        },
        "pool": pool,
        "workload": w.what,
        "lengths": {
            "requests": w.requests,
            "prompt_mean": round(sum(p for p, _ in lengths) / len(lengths), 1),
            "output_mean": round(sum(o for _, o in lengths) / len(lengths), 1),
            "prompt_max": max(p for p, _ in lengths),
            "output_max": max(o for _, o in lengths),
        },
        "latency_bound_s": w.latency_bound_s,
        "summary": summary,
        "targets": targets,
        "runs": runs,
        "plot": args.plot,  # where --plot drew the figure (None: not drawn)
    }
    if args.plot:
        plot(report, args.plot)
    return report


def _engine(loaded, folder: str, system: str, args: argparse.Namespace, w: ReservationWorkload):
    from worker.engine import EngineConfig, LLMEngine

    return LLMEngine(
        loaded,
        EngineConfig(
            model=folder,
            device=args.device,
            clock=args.clock,
            dtype=loaded.config.dtype,
            worker_id=f"bench-{system}",
            block_size=w.block_size,
            num_blocks=w.num_blocks,
            enable_prefix_caching=False,
            kv_reservation=system,
            max_num_seqs=w.max_num_seqs,
            max_model_len=w.max_len,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
    )


def _pool(engine) -> dict:
    pool = engine.kv_pool
    return {
        "num_blocks": pool.num_blocks,
        "block_size": pool.block_size,
        "tokens": pool.tokens_capacity,
        "gib": round(pool.bytes_total / 2**30, 2),
    }


def _run(engine, lengths: list[tuple[int, int]], arrivals: list[float]) -> dict:
    """Serve every request at its arrival time (the engine's clock); the figures of the run."""
    from worker.engine import SamplingParams

    clock, scheduler, B = engine.clock, engine.scheduler, engine.block_size
    vocab = engine.loaded.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(p)] for p, _ in lengths]
    start = clock.now()
    arrived: dict[str, float] = {}
    latency: dict[str, float] = {}
    nxt = 0
    # time-weighted sums over the run: stored tokens, held slots, running requests
    stored = held = batch = 0.0
    last_t, last = start, (0, 0, 0)
    while nxt < len(arrivals) or engine.has_unfinished():
        now = clock.now() - start
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            rid = f"r{nxt}"
            engine.add_request(
                prompts[nxt],
                SamplingParams(max_tokens=lengths[nxt][1], ignore_eos=True),
                request_id=rid,
            )
            arrived[rid] = arrivals[nxt]
            nxt += 1
        if not engine.has_unfinished():  # idle until the next arrival
            clock.wait_until(start + arrivals[nxt])
            continue
        for out in engine.step():
            if out.finished:
                latency[out.request_id] = clock.now() - start - arrived[out.request_id]
        t = clock.now()
        dt = t - last_t
        stored, held, batch = stored + last[0] * dt, held + last[1] * dt, batch + last[2] * dt
        running = scheduler.running
        last = (
            sum(s.num_stored for s in running),
            sum(len(s.block_table) for s in running) * B,
            len(running),
        )
        last_t = t
    elapsed = clock.now() - start
    outputs = {f"r{i}": o for i, (_, o) in enumerate(lengths)}
    normalized = [latency[r] / outputs[r] for r in latency]
    return {
        "requests": len(latency),
        "normalized_latency_s": round(sum(normalized) / len(normalized), 4),
        "latency_mean_s": round(sum(latency.values()) / len(latency), 3),
        "latency_p90_s": round(harness.percentile(latency.values(), 0.9), 3),
        "kv_utilisation": round(stored / held, 4) if held else None,
        "requests_running_mean": round(batch / elapsed, 2) if elapsed else None,
        "preemptions": engine.num_preemptions,
        "served_s": round(elapsed, 1),
    }


def _summary(runs: list[dict], bound: float) -> dict:
    """The highest rate under the bound (every lower one under it too) and its figures."""
    best = None
    for r in runs:
        if r["normalized_latency_s"] >= bound:
            break
        best = r
    return {
        "max_rate_rps": None if best is None else best["rate_rps"],
        "normalized_latency_s": None if best is None else best["normalized_latency_s"],
        "kv_utilisation": None if best is None else best["kv_utilisation"],
        "requests_running_mean": None if best is None else best["requests_running_mean"],
    }


def plot(report: dict, path: str | Path) -> None:
    """Normalized latency against rate, a line per system, the
    bound dashed (the paper's Figure 12)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for system, runs in report["runs"].items():
        ax.plot(
            [r["rate_rps"] for r in runs],
            [r["normalized_latency_s"] for r in runs],
            marker="o",
            label=LABELS.get(system, system),
        )
    ax.axhline(
        report["latency_bound_s"],
        color="grey",
        linestyle="--",
        linewidth=1,
        label=f"bound {report['latency_bound_s']:g} s/token",
    )
    top = report["latency_bound_s"] * 2.5
    ax.set_ylim(0, top)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(
        f"{report['model'].split(' ')[0]} on {report['device']} "
        f"({report['clock']} clock, simulated)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def tables(report: dict) -> list[Table]:
    systems = list(report["runs"])
    at = {s: {r["rate_rps"]: r for r in runs} for s, runs in report["runs"].items()}
    rates = sorted({rate for runs in at.values() for rate in runs})

    def figure(s: str, rate: float, key: str):
        return at[s].get(rate, {}).get(key)

    by_rate = [
        [cell(rate, "g"), *(cell(figure(s, rate, "normalized_latency_s"), ".3f") for s in systems)]
        for rate in rates
    ]
    utilisation = [
        [
            cell(rate, "g"),
            *(cell(figure(s, rate, "kv_utilisation"), ".1%") for s in systems),
            *(cell(figure(s, rate, "requests_running_mean"), ".1f") for s in systems),
        ]
        for rate in rates
    ]
    summary = [
        [
            s,
            cell(v["max_rate_rps"], "g"),
            cell(v["normalized_latency_s"], ".3f"),
            cell(v["kv_utilisation"], ".1%"),
            cell(v["requests_running_mean"], ".1f"),
        ]
        for s, v in report["summary"].items()
    ]
    t, pool, lengths, roof = (
        report["targets"],
        report["pool"] or {},
        report["lengths"],
        report["roofline"] or {},
    )
    kv = report.get("kv_cache_dtype", "auto")
    fp8 = "" if kv == "auto" else f", --kv-cache-dtype {kv}"
    notes = [
        f"Simulated: {report['model']} ({report['kv_bytes_per_token']:,} KV bytes per token{fp8}) "
        f"on {report['device']} ({roof.get('gpu', '-')}; roofline MFU {roof.get('mfu', '-')}, MBU "
        f"{roof.get('mbu', '-')}, launch {roof.get('launch_ms', '-')} ms), {report['clock']} "
        f"clock; KV pool {pool.get('num_blocks', '-')} blocks of {pool.get('block_size', '-')} "
        f"({pool.get('tokens', '-')} tokens, {pool.get('gib', '-')} GiB).",
        f"Workload: {report['workload']}; drawn: prompts {lengths['prompt_mean']} tokens on "
        f"average (at most {lengths['prompt_max']}), outputs "
        f"{lengths['output_mean']} (at most {lengths['output_max']}).",
        "max rate: the highest rate whose normalized latency (mean of latency / output tokens) is "
        f"under {report['latency_bound_s']:g} s/token, every lower rate too; a system's higher "
        "rates are not run once one is over it (-).",
        *(
            f"{key}: {cell(t[key], '.2f')} (target >= {t[f'{key}_target']:g}: "
            f"{verdict(t[f'{key}_met'])})"
            for key in TARGETS
        ),
        *(
            [f"Plot of normalized latency against rate: {report['plot']}."]
            if report.get("plot")
            else []
        ),
    ]
    return [
        Table(
            "Reservation baselines: the highest rate under the latency bound",
            [
                "system",
                "max rate (req/s)",
                "normalized latency (s/token)",
                "KV utilisation",
                "requests running",
            ],
            summary,
            notes,
        ),
        Table("Normalized latency (s/token) by request rate (req/s)", ["rate", *systems], by_rate),
        Table(
            "KV utilisation (stored tokens / slots held) and requests running, by rate",
            ["rate", *(f"{s} util." for s in systems), *(f"{s} running" for s in systems)],
            utilisation,
        ),
    ]


def run(args: argparse.Namespace) -> int:
    return harness.run("reservation", args, measure, tables)
