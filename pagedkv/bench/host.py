"""`pagedkv bench host`: what the host costs a GPU, on a simulated one or a real one.

A worker engine with Llama-3-8B's public config (bf16) on `--device`:
`sim:h100` by default (no weights: the simulated device's roofline times each
step, worker/sim/), or `cuda` (random weights, `--load-format dummy`, half of
the GPU's free memory for the KV pool), with the wall clock: the device's time
really passes while the host processes the last step's tokens, plans the next
step and calls the allocator, as against a GPU. For each allocator (`--allocators`: in-process, or a
real allocator process over gRPC) and each number of sequences running at once,
a closed loop of decode-heavy requests (a new one as each finishes) runs
until every first request has its first token, then for the timed steps:

- `device_busy_ratio`: device time / wall time over the timed steps: how
  much of the time the GPU computed rather than waited for the host;
- TPOT p50: the median gap between two tokens of a sequence;
- host ms per step by part (`pagedkv_worker_step_host_seconds`): schedule
  (planning the step and the next one's call), allocator wait (what async
  scheduling did not hide), sample (drawing tokens), output (stop checks,
  outputs).

The host figures are this machine's; the device's are the roofline's
(docs/simulator.md), labelled simulated.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import random
import statistics
import tempfile
from collections.abc import Callable

from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell, verdict
from pagedkv.bench.systems.allocators import deploy
from pagedkv.bench.workloads import HOST, HostWorkload, decode_heavy_request

ALLOCATORS = ("embedded", "grpc")
PARTS = ("schedule", "allocator_wait", "sample", "output")
TARGET_BUSY = 0.95  # at 256 sequences over gRPC: the host never makes the GPU wait more than 5%
_IDS = itertools.count(1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_workload_option(parser, HOST)
    parser.add_argument(
        "--device",
        default="sim:h100",
        metavar="sim:NAME|cuda",
        help="a simulated GPU, or cuda: a real one running the model with random weights "
        "(worker --device) [sim:h100]",
    )
    parser.add_argument(
        "--allocators",
        type=harness.comma_list(ALLOCATORS),
        default=list(ALLOCATORS),
        help="which allocators: embedded (in the engine's process), grpc (an allocator process) "
        "[embedded,grpc]",
    )
    harness.add_json_option(parser)


def measure(args: argparse.Namespace) -> dict:
    from worker.engine import LLMEngine
    from worker.sim import is_sim, write_config

    sim = is_sim(args.device)
    if not sim and args.device != "cuda":
        from pagedkv_base.settings import CliError

        raise CliError(f"--device must be a simulated GPU (sim:NAME) or cuda, got {args.device!r}")
    w = HOST[args.workload]
    cases, roofline, device_name = [], None, args.device
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-host-") as folder:
        write_config("llama-3-8b", folder)
        loaded = model_for(folder, args.device)
        if not sim:
            import torch

            device_name = f"cuda ({torch.cuda.get_device_name()}, torch {torch.__version__})"
        for kind in args.allocators:
            with contextlib.ExitStack() as stack:
                address = deploy(stack, kind)
                for n in w.sizes:
                    harness.log("host", f"{kind}, {n} sequences")
                    engine = LLMEngine(loaded, engine_config(folder, args.device, address, n, w))
                    try:
                        roofline = getattr(engine.runner, "roofline", None)
                        cases.append({"allocator": kind, "seqs": n, **_case(engine, n, w)})
                    finally:
                        engine.close()
                        del engine
                        _free(args.device)
    summary = {
        f"{c['allocator']}/{c['seqs']}": {
            k: c[k]
            for k in ("device_busy_ratio", "tpot_p50_ms", "device_ms_per_step", "host_ms_per_step")
        }
        for c in cases
    }
    grpc_256 = summary.get("grpc/256", {}).get("device_busy_ratio")
    return {
        "device": device_name,
        "simulated": sim,
        "model": "llama-3-8b (public config.json, bfloat16" + (")" if sim else "; random weights)"),
        "roofline": None
        if roofline is None
        else {
            "gpu": roofline.gpu.description,
            "mfu": roofline.mfu,
            "mbu": roofline.mbu,
            "launch_ms": roofline.launch_s * 1e3,
        },
        "workload": w.what,
        "summary": summary,
        "cases": cases,
        "targets": {
            "device_busy_ratio_grpc_256": grpc_256,
            "target": TARGET_BUSY,
            "met": None if grpc_256 is None else grpc_256 >= TARGET_BUSY,
        },
    }


def model_for(folder: str, device: str):
    """The model once for every case: its shape on a simulated
    device, random weights on a real one."""
    from worker.sim import is_sim

    if is_sim(device):
        from worker.model.sim import load_sim_model

        return load_sim_model(folder)
    from worker.model.loader import load_model

    return load_model(folder, device, "bfloat16", load_format="dummy")


def _free(device: str) -> None:
    """A real device's KV pool goes with its engine before the next one takes its memory."""
    if device == "cuda":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def engine_config(folder: str, device: str, address: str, n: int, w: HostWorkload):
    from worker.engine import EngineConfig

    # on a real GPU half of its free memory (the weights
    # loaded) for the KV pool; a simulated one sizes its own
    memory = {"kv_cache_memory": "0.5"} if device == "cuda" else {}
    return EngineConfig(
        model=folder,
        device=device,
        dtype="bfloat16",
        allocator=address,
        worker_id=f"bench-host-{next(_IDS)}",
        enable_prefix_caching=True,
        max_num_seqs=n,
        max_num_batched_tokens=w.max_num_batched_tokens,
        **memory,
    )


def closed_loop(engine, n: int, w: HostWorkload) -> Callable[[], None]:
    """`n` decode-heavy requests of `w` added to `engine`, and
    what adds one more (as one finishes)."""
    from worker.engine import SamplingParams

    rng = random.Random(w.seed + n)
    vocab = engine.loaded.config.vocab_size

    def add() -> None:
        prompt, out = decode_heavy_request(rng, w, vocab)
        engine.add_request(prompt, SamplingParams(max_tokens=out, ignore_eos=True))

    for _ in range(n):
        add()
    return add


def warm_up(engine, n: int, add: Callable[[], None]) -> None:
    """Steps until each of the first `n` requests has its first token (every prompt prefilled)."""
    firsts = 0
    while firsts < n:
        for out in engine.step():
            if len(out.token_ids) == 1:
                firsts += 1
            if out.finished:
                add()


def _case(engine, n: int, w: HostWorkload) -> dict:
    add = closed_loop(engine, n, w)
    last: dict[tuple[str, int], float] = {}
    warm_up(engine, n, add)
    metrics, clock = engine.metrics, engine.clock
    host0 = _host_sums(metrics)
    t0 = clock.now()  # (then the device time up to it: a busy share over the span is never above 1)
    busy0 = engine.busy.computed()
    tokens, gaps = 0, []
    for _ in range(w.steps):
        outs = engine.step()
        now = clock.now()
        for out in outs:
            key = (out.request_id, out.index)
            if key in last:
                gaps.append(now - last[key])
            last[key] = now
            tokens += len(out.new_token_ids)
            if out.finished:
                last.pop(key, None)
                add()
    busy = engine.busy.computed() - busy0
    elapsed = clock.now() - t0
    host = {p: (s - host0[p]) / w.steps * 1e3 for p, s in _host_sums(metrics).items()}
    return {
        "steps": w.steps,
        "wall_s": round(elapsed, 3),
        "device_busy_ratio": round(busy / elapsed, 4),
        "tpot_p50_ms": round(1e3 * harness.percentile(gaps, 0.5), 3) if gaps else None,
        "tpot_mean_ms": round(1e3 * statistics.fmean(gaps), 3) if gaps else None,
        "tokens_per_s": round(tokens / elapsed, 1),
        "device_ms_per_step": round(busy / w.steps * 1e3, 3),
        "host_ms_per_step": {p: round(v, 3) for p, v in host.items()},
        "host_ms_per_step_total": round(sum(host.values()), 3),
        "preemptions": engine.num_preemptions,
        "load_average_1m": harness.load_average(),
    }


def _host_sums(metrics) -> dict[str, float]:
    get = metrics.registry.get_sample_value
    return {
        p: get("pagedkv_worker_step_host_seconds_sum", {**metrics.labels, "part": p}) or 0.0
        for p in PARTS
    }


def tables(report: dict) -> list[Table]:
    roof = report.get("roofline") or {}
    rows = [
        [
            f"{c['allocator']}/{c['seqs']}",
            cell(c["device_busy_ratio"], ".3f"),
            cell(c["tpot_p50_ms"], ".2f"),
            cell(c["device_ms_per_step"], ".2f"),
            *(cell(c["host_ms_per_step"][p], ".3f") for p in PARTS),
            cell(c["host_ms_per_step_total"], ".3f"),
            cell(c["tokens_per_s"], ",.0f"),
        ]
        for c in report["cases"]
    ]
    t = report["targets"]
    device = (
        f"Device: {report['device']} ({roof.get('gpu', '-')}), simulated: a roofline with MFU "
        f"{roof.get('mfu')}, MBU {roof.get('mbu')}, launch {roof.get('launch_ms')} ms; the host's "
        "times are this machine's, measured."
        if report.get("simulated", True)
        else f"Device: {report['device']}, real: device time from CUDA events around each step's "
        "forward pass and sampling; the host's times are this machine's."
    )
    notes = [
        device,
        f"Model: {report['model']}. Workload: {report['workload']}.",
        "device busy: device time / wall time over the timed steps. TPOT p50: the median gap "
        "between two tokens of a sequence. Host ms per step: "
        "pagedkv_worker_step_host_seconds by part, per timed step.",
        f"Target: device busy >= {t['target']} at grpc/256: "
        + (
            "not measured"
            if t["device_busy_ratio_grpc_256"] is None
            else f"{t['device_busy_ratio_grpc_256']:.3f} ({verdict(t['met'])})"
        )
        + ".",
    ]
    kind = "a simulated GPU" if report.get("simulated", True) else "a real GPU"
    return [
        Table(
            f"Host time against {kind} (allocator/sequences running)",
            [
                "case",
                "device busy",
                "TPOT p50 ms",
                "device ms/step",
                "schedule ms",
                "allocator wait ms",
                "sample ms",
                "output ms",
                "host ms",
                "tokens/s",
            ],
            rows,
            notes,
        )
    ]


def run(args: argparse.Namespace) -> int:
    return harness.run("host", args, measure, tables)
