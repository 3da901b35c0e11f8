"""`pagedkv bench attention`: paged decode attention vs contiguous SDPA on the same data.

For each (batch, context) the same K/V lives twice: scattered over a KV pool
through shuffled block tables, and as contiguous `[batch, kv_heads, context,
head_dim]` tensors. We time one decode attention call (one query token per
sequence) both ways, alternately, and report the median ms per call and the
median of the per-pair ratios paged / contiguous.
The paged figure is per layer with the step's gather plan already built (as
layers 2..N find it); `plan_ms_per_step` is the one-off cost of building it. Both sides
use the same GQA grouping (query heads folded onto their kv head), so the
ratio measures the cost of paging alone. The workload (`workloads.ATTENTION`)
has SmolLM2-135M's head shapes (9 query heads, 3 kv heads, head_dim 64).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

from allocator_service.core import blocks_for
from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.workloads import ATTENTION, AttentionWorkload

__all__ = ["add_arguments", "measure", "run", "tables"]


_BACKENDS = ("torch", "numba", "triton")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_workload_option(parser, ATTENTION)
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument(
        "--backend",
        type=harness.comma_list(_BACKENDS),
        default=None,
        help="comma list of torch, numba, triton, timed side "
        "by side (default: the device's, numba on the CPU)",
    )
    parser.add_argument(
        "--repeats",
        type=harness.positive,
        default=10,
        help="timed calls per case (median reported)",
    )
    parser.add_argument(
        "--threads",
        type=harness.positive,
        default=None,
        help="torch CPU threads (default: torch's)",
    )
    harness.add_json_option(parser)


def _median_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: allocator, kernels, caches
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _paired_ms(
    a: Callable[[], object], b: Callable[[], object], repeats: int, sync: Callable[[], None]
) -> tuple[float, float, float]:
    """Median ms of `a` and of `b`, timed alternately, and the median of the
    per-pair ratios b / a: on a shared machine a burst of load hits both sides
    of a pair, so the ratio is steadier than either time."""
    a(), b()
    sync()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            sync()
            out.append((time.perf_counter() - start) * 1e3)
    ratios = [y / x for x, y in zip(ta, tb, strict=True)]
    return statistics.median(ta), statistics.median(tb), statistics.median(ratios)


def _case(
    args: argparse.Namespace, w: AttentionWorkload, names: list[str], batch: int, context: int
) -> dict:
    import torch
    import torch.nn.functional as F

    from worker.attention import AttentionMetadata, get_backend
    from worker.kv_pool import KVPool

    dtype = getattr(torch, w.dtype)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(w.seed)
    block = w.block_size
    blocks_per_seq = blocks_for(context, block)
    pool = KVPool(1, batch * blocks_per_seq, block, w.kv_heads, w.head_dim, dtype, device)
    order = torch.randperm(pool.num_blocks, generator=gen).tolist()
    tables = [order[s * blocks_per_seq : (s + 1) * blocks_per_seq] for s in range(batch)]

    k = torch.randn(batch, context, w.kv_heads, w.head_dim, generator=gen).to(device, dtype)
    v = torch.randn(batch, context, w.kv_heads, w.head_dim, generator=gen).to(device, dtype)
    fill = AttentionMetadata.build([(t, 0, context) for t in tables], block, device)
    pool.write(
        0,
        fill.slot_mapping,
        k.reshape(-1, w.kv_heads, w.head_dim),
        v.reshape(-1, w.kv_heads, w.head_dim),
    )
    meta = AttentionMetadata.build([(t, context - 1, 1) for t in tables], block, device)
    k_contig = k.transpose(1, 2).contiguous()  # [b, Hkv, ctx, D]
    v_contig = v.transpose(1, 2).contiguous()
    q = torch.randn(batch, w.q_heads, w.head_dim, generator=gen).to(device, dtype)
    scale = w.head_dim**-0.5
    group = w.q_heads // w.kv_heads

    kc, vc = pool.k_cache(0), pool.v_cache(0)

    def contiguous() -> torch.Tensor:
        qg = q.view(batch, w.kv_heads, group, w.head_dim)
        return F.scaled_dot_product_attention(qg, k_contig, v_contig, scale=scale).reshape(q.shape)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result: dict = {"batch": batch, "context": context}
    with torch.inference_mode():
        # Each backend is timed call by call alternately with contiguous SDPA, so
        # that the ratio compares figures taken under the same load of the machine.
        for name in names:
            backend = get_backend(name)

            def paged(backend=backend) -> torch.Tensor:
                # The same metadata object every call, as layers 2..N of a step see it:
                # the backend's per-step plan (gather indices) is reused.
                return backend(q, kc, vc, meta, scale)

            def paged_new_step(backend=backend) -> torch.Tensor:
                # A fresh metadata object: the plan is rebuilt, as on a step's first layer.
                return backend(q, kc, vc, dataclasses.replace(meta), scale)

            err = (paged().float() - contiguous().float()).abs().max().item()
            contig_ms, paged_ms, ratio = _paired_ms(contiguous, paged, args.repeats, sync)
            first_ms = _median_ms(paged_new_step, args.repeats, sync)
            result[name] = {
                "paged_ms": round(paged_ms, 4),
                "contiguous_ms": round(contig_ms, 4),
                "ratio": round(ratio, 3),
                "plan_ms_per_step": round(max(first_ms - paged_ms, 0.0), 4),
                "max_abs_diff": err,
            }
    return result


def default_backend(device: str) -> str:
    """The name `select_backend` picks for `device`."""
    import importlib.util

    import torch

    if torch.device(device).type != "cuda":
        return "numba"
    return "triton" if importlib.util.find_spec("triton") is not None else "torch"


def measure(args: argparse.Namespace) -> dict:
    """Run every (batch, context) case; the report as a dict (what --json prints)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    w = ATTENTION[args.workload]
    names = args.backend or [default_backend(args.device)]
    return {
        "benchmark": "paged decode attention vs contiguous SDPA",
        "device": str(args.device),
        "backends": names,
        "dtype": w.dtype,
        "threads": torch.get_num_threads(),
        "block_size": w.block_size,
        "q_heads": w.q_heads,
        "kv_heads": w.kv_heads,
        "head_dim": w.head_dim,
        "results": [_case(args, w, names, b, c) for c in w.contexts for b in w.batch_sizes],
    }


def tables(report: dict) -> list[Table]:
    rows = [
        [
            name,
            cell(r["batch"]),
            cell(r["context"]),
            cell(r[name]["paged_ms"], ".3f"),
            cell(r[name]["contiguous_ms"], ".3f"),
            cell(r[name]["ratio"], ".2f"),
            cell(r[name]["plan_ms_per_step"], ".3f"),
        ]
        for r in report["results"]
        for name in report["backends"]
    ]
    return [
        Table(
            title=f"{report['benchmark']} ({report['dtype']}, {report['device']}, "
            f"{report['threads']} threads, block {report['block_size']}, "
            f"{report['q_heads']}q/{report['kv_heads']}kv x {report['head_dim']})",
            columns=[
                "backend",
                "batch",
                "context",
                "paged ms",
                "contig ms",
                "ratio",
                "plan ms/step",
            ],
            rows=rows,
        )
    ]


def run(args: argparse.Namespace) -> int:
    """The `pagedkv bench attention` entry point: print the report, exit status 0."""
    return harness.run("attention", args, measure, tables)
