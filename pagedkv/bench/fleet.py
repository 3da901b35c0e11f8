"""`pagedkv bench fleet`: how many GPU workers one allocator process serves
before their devices wait on it.

A worker engine (Llama-3-8B's public config on `sim:h100`, the real
scheduler with lookahead and async scheduling, the virtual clock) runs
`HOST`'s decode-heavy closed loop against an allocator process while its
Step stream is recorded (`systems.recording`). Then, for each number of
workers N (`--workers`) and of allocator processes M (`--allocators`: the
pools sharded over them as `pagedkv up` shards, worker i on allocator
i mod M), N workers replay that stream at its recorded cadence from one
asyncio load generator, each with a pool of its own, against M fresh
allocator processes. Allocator i is pinned to core i, the load generator to
the cores left (where the machine has them; on 2 cores with M = 2 it shares).

Per (M, N), over the Steps past the recorded worker's warm-up:

- Step latency p50/p99, where the load generator sees it;
- device idle: sum over Steps of max(0, latency - the device's step time)
  / the workers' wall time: the share of time a device waited on the
  allocator;
- the allocators' CPU seconds per second and RSS (from /proc), over the replay;
- errors: failed calls, and answers that differ from the recording's (the
  answers to a recorded stream are deterministic);
- the load generator's CPU per call and how late it sent Steps (both from
  the first worker's start to the last one's end).

`knee_workers` (per M): the largest N that kept device idle at or below 1%.
Memory: an allocator's RSS per block of state, empty pools and pools filled
with hashed blocks. The call floor: the allocator's CPU per Step that
carries no operation, run in process (the servicer's `Step`) and sent over
StepStream and as unary calls to an allocator process: what every call
pays before its operations, and how much of it the transport is.
`--profile PATH`: one more replay, at the knee, with the
allocator's every thread under cProfile (`systems.profiled`: thread CPU
time, so the profiler's own cost inflates every figure: read the shares);
its stats go to PATH (pstats) and its top lines to the report, by
cumulative time (this tree's functions) and by self time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time

from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.systems.recording import RecordedStep, Recording, recording_allocator
from pagedkv.bench.workloads import FLEET, FleetWorkload, HostWorkload

IDLE_TARGET = 0.01  # device idle from allocator waits at the knee
TOP = 15  # profile lines kept per ordering


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_workload_option(parser, FLEET)
    parser.add_argument(
        "--workers",
        type=harness.comma_list(low=1),
        default=None,
        metavar="LIST",
        help="numbers of replayed workers, one case each [the workload's]",
    )
    parser.add_argument(
        "--allocators",
        type=harness.comma_list(low=1, high=64),
        default=[1],
        metavar="LIST",
        help="numbers of allocator processes the pools are sharded over, each a series [1]",
    )
    parser.add_argument(
        "--lookahead",
        type=int,
        default=None,
        metavar="SLOTS",
        help="the recorded worker's lookahead slots (worker --num-lookahead-slots): 0 = a call "
        "every step [the worker's default]",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="also replay once with one allocator under cProfile, every thread, and write its "
        "stats to PATH (pstats); the top lines go in the report",
    )
    parser.add_argument(
        "--profile-workers",
        type=harness.positive,
        default=None,
        metavar="N",
        help="the workers of the --profile replay [the knee of one allocator, else the fewest]",
    )
    harness.add_json_option(parser)


def measure(args: argparse.Namespace) -> dict:
    w = FLEET[args.workload]
    workers = sorted(args.workers or w.workers)
    cores = sorted(os.sched_getaffinity(0))
    with contextlib.ExitStack() as stack:
        harness.log("fleet", f"recording one worker ({w.worker.sizes[0]} sequences)")
        server = _allocators(stack, 1, cores)[0]
        recording = record(server.address, w.worker, lookahead=args.lookahead)
    timed = recording.steps[recording.timed_from :]
    cases = []
    for m in sorted(args.allocators):
        for n in workers:
            harness.log("fleet", f"{m} allocator(s), {n} workers")
            cases.append({"allocators": m, "workers": n, **_case(recording, m, n, cores)})
    knees = {
        str(m): _knee([c for c in cases if c["allocators"] == m]) for m in sorted(args.allocators)
    }
    profile = None
    if args.profile:
        n = args.profile_workers or knees.get("1") or workers[0]
        harness.log("fleet", f"profiling one allocator at {n} workers")
        profile = {
            "workers": n,
            "path": args.profile,
            **_profiled(recording, n, cores, args.profile),
        }
    summary: dict[str, dict] = {}
    for c in cases:
        summary.setdefault(str(c["workers"]), {})[str(c["allocators"])] = {
            k: c[k]
            for k in (
                "step_p50_ms",
                "step_p99_ms",
                "device_idle",
                "allocator_cpu_per_s",
                "allocator_cpu_ms_per_step",
                "allocator_rss_mib",
                "errors",
            )
        }
    return {
        "device": "sim:h100",
        "model": "llama-3-8b (public config.json, bfloat16)",
        "workload": f"{w.what}; replayed by {', '.join(map(str, workers))} workers",
        "cores": len(cores),
        "recording": {
            "lookahead": recording.lookahead,
            "steps": len(recording.steps),
            "timed_steps": len(timed),
            "device_ms_per_step": _ms(sum(s.device_s for s in timed) / len(timed))
            if timed
            else None,
            "request_bytes_mean": round(sum(len(s.request) for s in timed) / len(timed))
            if timed
            else None,
            "response_bytes_mean": round(sum(len(s.response) for s in timed) / len(timed))
            if timed
            else None,
        },
        "summary": summary,
        "cases": cases,
        "memory": _memory(w, cores),
        "call_floor": _call_floor(w.floor_calls, cores),
        "profile": profile,
        "targets": {"knee_workers": knees, "idle_target": IDLE_TARGET},
    }


def record(
    address: str,
    w: HostWorkload,
    device: str = "sim:h100",
    model: str = "llama-3-8b",
    lookahead: int | None = None,
) -> Recording:
    """One engine running `w.sizes[0]` of `w`'s requests at once on `device`, virtual clock, against
    the allocator at `address`: its Steps through the warm-up and `w.steps` engine steps more.
    `lookahead`: the engine's lookahead slots (None: its default)."""
    import tempfile
    from dataclasses import replace

    from allocator_service.wire.codec import shape_to_proto
    from pagedkv.bench.host import closed_loop, engine_config, model_for, warm_up
    from worker.engine import LLMEngine
    from worker.sim import write_config

    n = w.sizes[0]
    now: list = [time.monotonic]  # the engine's clock once it exists
    cls = recording_allocator(lambda: now[0]())
    made = []

    def connect(spec):
        made.append(cls(address, spec))
        return made[-1]

    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-fleet-") as folder:
        write_config(model, folder)
        config = replace(engine_config(folder, device, address, n, w), clock="virtual")
        if lookahead is not None:
            config = replace(config, num_lookahead_slots=lookahead)
        engine = _DeviceTimed(
            LLMEngine(model_for(folder, device), config, allocator=connect), made[-1]
        )
        try:
            now[0] = engine.clock.now
            add = closed_loop(engine, n, w)
            warm_up(engine, n, add)
            timed_from = len(engine.client.sent)
            for _ in range(w.steps):
                for out in engine.step():
                    if out.finished:
                        add()
            sent, device_s = list(engine.client.sent), engine.device_s
            shape = shape_to_proto(engine.client.spec.config).SerializeToString()
        finally:
            engine.close()
    t0 = sent[0][0] if sent else 0.0
    steps = [
        RecordedStep(t - t0, d, req, resp) for (t, req, resp), d in zip(sent, device_s, strict=True)
    ]
    return Recording(shape, steps, timed_from, config.num_lookahead_slots)


class _DeviceTimed:
    """An engine whose every step's device time is noted for each Step its client sent in it:
    on the virtual clock, which moves only while the
    host waits for the device, by one step of it."""

    def __init__(self, engine, client) -> None:
        self.engine, self.client = engine, client
        self.device_s: list[float] = []

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def step(self):
        c0 = self.engine.clock.now()
        outs = self.engine.step()
        self.device_s += [self.engine.clock.now() - c0] * (
            len(self.client.sent) - len(self.device_s)
        )
        return outs


def _allocators(
    stack: contextlib.ExitStack, m: int, cores: list[int], profile: str | None = None
) -> list:
    """M allocator processes, allocator i pinned to core i (mod the cores), stopped with `stack`."""
    from pagedkv.bench.systems.profiled import ProfiledAllocator
    from pagedkv.stack.services import AllocatorProcess

    servers = []
    for i in range(m):
        server = (ProfiledAllocator(profile) if profile else AllocatorProcess()).start()
        stack.callback(server.terminate)
        server.wait_healthy(30)
        if len(cores) > 1:
            os.sched_setaffinity(server.pid, {cores[i % len(cores)]})
        servers.append(server)
    return servers


@contextlib.contextmanager
def _pinned_after(cores: list[int], m: int):
    """This process (the load generator) on the cores after the first M, or on the last one."""
    before = os.sched_getaffinity(0)
    if len(cores) > 1:
        os.sched_setaffinity(0, set(cores[m:]) or {cores[-1]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _case(recording, m: int, n: int, cores: list[int], profile: str | None = None) -> dict:
    import psutil

    from pagedkv.bench.systems.recording import replay

    with contextlib.ExitStack() as stack:
        servers = _allocators(stack, m, cores, profile)
        procs = [psutil.Process(s.pid) for s in servers]
        with _pinned_after(cores, m):
            machine = harness.OtherCpu()
            runs, (cpu0, me0, t0), (cpu1, me1, t1) = asyncio.run(
                replay(
                    [s.address for s in servers],
                    recording,
                    n,
                    sample=lambda: (_cpu(procs), time.process_time(), time.monotonic()),
                )
            )
            busy = machine.share()  # everything but this process, the allocators included
        rss = sum(p.memory_info().rss for p in procs)
    latencies = [x for r in runs for x in r.latencies]
    wall = sum(r.wall_s for r in runs)
    calls = sum(r.calls for r in runs)
    failed = [e for r in runs for e in r.errors]
    mismatches = sum(r.mismatches for r in runs)
    return {
        "step_p50_ms": _ms(harness.percentile(latencies, 0.5)),
        "step_p99_ms": _ms(harness.percentile(latencies, 0.99)),
        "device_idle": round(sum(r.idle_s for r in runs) / wall, 4) if wall > 0 else None,
        "device_idle_worst": max(
            (round(r.idle_s / r.wall_s, 4) for r in runs if r.wall_s > 0), default=None
        ),
        "allocator_cpu_per_s": round((cpu1 - cpu0) / (t1 - t0), 3),
        # the same replayed Steps cost this much whatever the answers' delays
        "allocator_cpu_ms_per_step": round((cpu1 - cpu0) / calls * 1e3, 3) if calls else None,
        "allocator_rss_mib": round(rss / 2**20, 1),
        "errors": len(failed) + mismatches,
        "failed_calls": len(failed),
        "mismatches": mismatches,
        "first_error": failed[0] if failed else None,
        "unary_workers": sum(r.unary for r in runs),
        "calls": calls,
        "replay_s": round(t1 - t0, 2),
        "loadgen_cpu_us_per_call": round((me1 - me0) / calls * 1e6, 1) if calls else None,
        "loadgen_late_p99_ms": _ms(harness.percentile([x for r in runs for x in r.late], 0.99)),
        "other_cpu_share": None
        if busy is None
        else round(max(0.0, busy - (cpu1 - cpu0) / (t1 - t0) / len(cores)), 3),
        "load_average_1m": harness.load_average(),
    }


def _cpu(procs) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _knee(cases: list[dict]) -> int | None:
    """The largest N that kept device idle at or below the target, error-free."""
    return max(
        (
            c["workers"]
            for c in cases
            if c["device_idle"] is not None and c["device_idle"] <= IDLE_TARGET and not c["errors"]
        ),
        default=None,
    )


def _profiled(recording, n: int, cores: list[int], path: str) -> dict:
    import pstats

    case = _case(recording, 1, n, cores, profile=path)
    stats = pstats.Stats(path)
    ours = ("allocator_service/", "pagedkv/", "pagedkv_base/")
    return {
        "device_idle": case["device_idle"],
        "total_s": round(stats.total_tt, 3),
        "cumulative": _top(stats, "cumulative", lambda where: where.startswith(ours)),
        "self": _top(stats, "tottime"),
    }


def _top(stats, key: str, keep=lambda where: True) -> list[str]:
    """The first TOP functions by `key` whose place `keep` keeps: cumulative s, self s, calls, a
    share, where. By cumulative time the share is of the first one's (the outermost handler: every
    Step's time); by self time, of all the profiled time."""
    rows, whole = [], None
    for func in stats.sort_stats(key).fcn_list:
        _, calls, tottime, cumtime, _ = stats.stats[func]
        where = f"{_short(func[0])}:{func[1]}({func[2]})"
        if keep(where):
            mine, whole = (
                (cumtime, whole or cumtime) if key == "cumulative" else (tottime, stats.total_tt)
            )
            rows.append(
                f"{cumtime:8.3f} {tottime:8.3f} {calls:9d} "
                f"{100 * mine / whole if whole else 0:5.1f}%  {where}"
            )
        if len(rows) == TOP:
            break
    return rows


def _short(path: str) -> str:
    """A profiled function's file: from its package down (this
    tree's, an installed one's, the standard library's)."""
    for marker in ("site-packages/", f"python{sys.version_info[0]}.{sys.version_info[1]}/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return os.path.relpath(path) if path.startswith("/") else path


def _memory(w: FleetWorkload, cores: list[int]) -> dict:
    """An allocator's RSS per block: pools registered (empty), then filled with sequences whose
    every block is full (hashed, prefix caching on), over a fresh allocator's RSS."""
    import psutil

    from allocator_service.client import PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator
    from allocator_service.core import Admit, PoolConfig

    block_size, per_pool = 16, w.memory_blocks // w.memory_pools
    seq_blocks = 63
    with contextlib.ExitStack() as stack:
        server = _allocators(stack, 1, cores)[0]
        proc = psutil.Process(server.pid)
        base = proc.memory_info().rss
        pools = [
            GrpcAllocator(
                server.address,
                PoolSpec(
                    f"memory-{i}",
                    PoolConfig(
                        num_blocks=per_pool,
                        block_size=block_size,
                        enable_prefix_caching=True,
                        model_fingerprint="bench",
                    ),
                ),  # heart-beating: on a busy machine the fill outlasts a lease
            )
            for i in range(w.memory_pools)
        ]
        stack.callback(lambda: [p.close() for p in pools])
        empty = proc.memory_info().rss
        first = 0
        for pool in pools:
            for s in range(0, per_pool // seq_blocks, 16):
                # 16 admits of 1,008 distinct tokens per Step
                ops = []
                for j in range(s, min(s + 16, per_pool // seq_blocks)):
                    ops.append(Admit(f"s{j}", range(first, first + seq_blocks * block_size)))
                    first += seq_blocks * block_size
                if not pool.step(ops).all_ok:
                    raise RuntimeError("the memory pools are too small for their sequences")
        full = proc.memory_info().rss
    blocks = per_pool * w.memory_pools
    used = (per_pool // seq_blocks) * seq_blocks * w.memory_pools
    return {
        "blocks": blocks,
        "blocks_filled": used,
        "rss_mib_base": round(base / 2**20, 1),
        "bytes_per_block_empty": round((empty - base) / blocks, 1),
        "bytes_per_block_full": round((full - base) / blocks, 1),
    }


def _call_floor(calls: int, cores: list[int]) -> dict:
    """The allocator's CPU per Step with no operation (one pool, prefix
    caching on): `calls` of them in this process through the servicer (the
    service's own path, no transport), over one StepStream and as unary
    calls to an allocator process, one at a time (its CPU from /proc)."""
    import grpc
    import psutil

    from allocator_service.core import PoolConfig
    from allocator_service.rpc.servicer import AllocatorServicer
    from allocator_service.service import Advertised, AllocatorService
    from allocator_service.wire.codec import PROTOCOL_VERSION, shape_to_proto
    from allocator_service.wire.v1 import allocator_pb2 as pb
    from allocator_service.wire.v1.allocator_pb2_grpc import AllocatorStub

    config = PoolConfig(1024, 16, True, "bench")

    def steps(ref: pb.PoolRef, first: int, n: int):
        return (
            pb.StepRequest(pool=ref, step_id=k, prev_step_id=k - 1) for k in range(first, first + n)
        )

    service = AllocatorService()
    try:
        servicer = AllocatorServicer(service)
        r = service.pools.register("floor", config, "", Advertised("", ""), PROTOCOL_VERSION)
        requests = list(steps(pb.PoolRef(pool_id=r.pool_id, credential=r.credential), 1, calls))
        t0 = time.thread_time()
        for request in requests:
            with service.fair.call(r.pool_id):
                servicer.Step(request, None).SerializeToString()
        in_process = (time.thread_time() - t0) / calls
    finally:
        service.close()
    with contextlib.ExitStack() as stack:
        server = _allocators(stack, 1, cores)[0]
        proc = psutil.Process(server.pid)
        channel = stack.enter_context(grpc.insecure_channel(server.address))
        stub = AllocatorStub(channel)
        reg = stub.RegisterPool(
            pb.RegisterPoolRequest(
                worker_id="floor", shape=shape_to_proto(config), protocol_version=PROTOCOL_VERSION
            )
        )
        ref = pb.PoolRef(pool_id=reg.pool_id, credential=reg.credential)
        with _pinned_after(cores, 1):
            cpu0 = _cpu([proc])
            answered = sum(1 for _ in stub.StepStream(steps(ref, 1, calls)))
            cpu1 = _cpu([proc])
            for request in steps(ref, calls + 1, calls):
                stub.Step(request)
            cpu2 = _cpu([proc])
    if answered != calls:
        raise RuntimeError(f"the StepStream answered {answered} of {calls} Steps")
    return {
        "calls": calls,
        "in_process_us": round(in_process * 1e6, 1),
        "stream_us": round((cpu1 - cpu0) / calls * 1e6, 1),
        "unary_us": round((cpu2 - cpu1) / calls * 1e6, 1),
    }


def tables(report: dict) -> list[Table]:
    rows = [
        [
            cell(c["allocators"]),
            cell(c["workers"]),
            cell(c["step_p50_ms"], ".2f"),
            cell(c["step_p99_ms"], ".2f"),
            cell(None if c["device_idle"] is None else 100 * c["device_idle"], ".1f"),
            cell(c["allocator_cpu_per_s"], ".2f"),
            cell(c.get("allocator_cpu_ms_per_step"), ".2f"),
            cell(c["allocator_rss_mib"], ".0f"),
            cell(c["errors"]),
            cell(c["unary_workers"]),
            cell(c["loadgen_cpu_us_per_call"], ".0f"),
            cell(c["loadgen_late_p99_ms"], ".2f"),
            cell(c.get("other_cpu_share"), ".0%"),
        ]
        for c in report["cases"]
    ]
    rec, t, mem = report["recording"], report["targets"], report["memory"]
    knees = ", ".join(f"{m} allocator(s): {cell(k)}" for m, k in t["knee_workers"].items())
    notes = [
        f"Workload: {report['workload']}. Recorded with {cell(rec.get('lookahead'))} lookahead "
        f"slots: {rec['steps']} Steps, {rec['timed_steps']} past the warm-up, "
        f"the device's step {cell(rec['device_ms_per_step'], '.2f')} ms (sim:h100 roofline), "
        f"requests of {cell(rec['request_bytes_mean'], ',')} bytes on average.",
        "Step ms: where the load generator sees it. Idle %: sum of max(0, Step latency - device "
        "step time) over the workers' wall time. CPU s/s and RSS: the allocator processes', "
        "summed; CPU ms/Step: their CPU per Step replayed (the same Steps' cost, however late "
        "their answers). Errors: failed calls and answers unlike the recording's. Unary: "
        "workers whose StepStream the server refused (its stream limit), sending unary Steps as "
        "a worker does. "
        "Loadgen: its CPU per call, and how late it sent (p99). Others' CPU: the machine's CPU "
        "that processes other than the benchmark's took meanwhile (they share the pinned cores).",
        f"Knee (the most workers at <= {100 * t['idle_target']:.0f}% device idle): {knees}. "
        f"On {report['cores']} cores; allocator i pinned "
        "to core i, the load generator to the others.",
    ]
    mem_rows = [
        [
            cell(mem["blocks"], ","),
            cell(mem["blocks_filled"], ","),
            cell(mem["rss_mib_base"], ".1f"),
            cell(mem["bytes_per_block_empty"], ".1f"),
            cell(mem["bytes_per_block_full"], ".1f"),
        ]
    ]
    out = [
        Table(
            "One allocator, many workers: Step stream replayed (allocators, workers)",
            [
                "allocators",
                "workers",
                "Step p50 ms",
                "Step p99 ms",
                "idle %",
                "CPU s/s",
                "CPU ms/Step",
                "RSS MiB",
                "errors",
                "unary",
                "loadgen us/call",
                "late p99 ms",
                "others' CPU",
            ],
            rows,
            notes,
        ),
        Table(
            "Allocator memory per block of state",
            ["blocks", "blocks filled", "base RSS MiB", "bytes/block empty", "bytes/block filled"],
            mem_rows,
            [
                "Filled: sequences of 63 full blocks of distinct "
                "tokens (every block hashed, prefix caching on)."
            ],
        ),
    ]
    floor = report.get("call_floor")
    if floor:
        out.append(
            Table(
                "What a call costs the allocator: a Step with no operation",
                ["path", "allocator CPU us per Step"],
                [
                    [what, cell(floor.get(key), ".0f")]
                    for what, key in (
                        ("in process (the servicer's Step, no transport)", "in_process_us"),
                        ("StepStream (gRPC)", "stream_us"),
                        ("unary Step (gRPC)", "unary_us"),
                    )
                ],
                [
                    f"{floor['calls']:,} Steps each way, one at a time, one pool; over gRPC the "
                    "allocator process's CPU (its every thread) per Step. A replayed Step "
                    "pays this before its operations."
                ],
            )
        )
    profile = report.get("profile")
    if profile:
        for key in ("cumulative", "self"):
            out.append(
                Table(
                    f"Allocator profile at {profile['workers']} workers, by {key} time "
                    f"({profile['total_s']} s profiled)",
                    ["cumulative s, self s, calls, share, function"],
                    [[line] for line in profile[key]],
                )
            )
    return out


def run(args: argparse.Namespace) -> int:
    return harness.run("fleet", args, measure, tables)
