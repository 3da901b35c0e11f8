"""The drill: the victim in a process of its own, each attack in turn against
a started stack, and the figures of every window."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pagedkv.bench import harness
from pagedkv.bench.attacks.evil import evil_worker
from pagedkv.bench.attacks.service import (
    big_tokenize,
    idle_connections,
    rogue_pool,
    slow_clients,
    slow_read_flood,
    snapshot_amplification,
    snapshot_watchers,
)
from pagedkv.bench.attacks.store import prompt_reading, store_emptying, store_poisoning
from pagedkv.bench.attacks.target import (
    ATTACKER,
    KEPT_ERRORS,
    MODEL,
    PROMPT,
    REQUEST_PAUSE_S,
    STEP_PAUSE_S,
    STORE_GIB,
    WORKER_ARGS,
    Sampler,
    Target,
    ms,
)
from pagedkv.bench.workloads import ATTACKS, AttackWorkload

STACKS = ("credentials", "none")


ATTACK_NAMES: dict[
    str, Callable[[Target, AttackWorkload], contextlib.AbstractContextManager[dict]]
] = {
    "rogue-pool": rogue_pool,
    "idle-connections": idle_connections,
    "slow-clients": slow_clients,
    "big-tokenize": big_tokenize,
    "slow-read-flood": slow_read_flood,
    "snapshot-amplification": snapshot_amplification,
    "snapshot-watchers": snapshot_watchers,
    "prompt-reading": prompt_reading,
    "store-poisoning": store_poisoning,
    "store-emptying": store_emptying,
    "evil-worker": evil_worker,
}


def _victim(
    allocator: str,
    token: str | None,
    router: str,
    worker: str,
    seqs: int,
    max_tokens: int,
    stop,
    ready,
    conn,
) -> None:
    """The victim's process: a pool's decode loop of Steps and a loop of
    router requests, until `stop`; then every sample through `conn`:
    steps and requests as (start, seconds, error or "", and for requests
    the worker that answered)."""
    import httpx

    from allocator_service.client import PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator
    from allocator_service.core import PoolConfig, blocks_for
    from pagedkv.bench.workloads import MAX_GEN, PROMPT_LEN, decode_steps

    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    want = httpx.post(worker + "/v1/completions", json=body, timeout=120).json()["choices"][0][
        "text"
    ]
    steps: list[tuple[float, float, str]] = []
    requests: list[tuple[float, float, str, str]] = []

    def step_loop() -> None:
        config = PoolConfig(
            seqs * (blocks_for(PROMPT_LEN + MAX_GEN, 16) + 2) + 64, 16, True, "bench"
        )
        pool = GrpcAllocator(allocator, PoolSpec("victim", config), auth_token=token)
        gen = decode_steps(seqs, seed=1)
        pool.step(next(gen))
        ready.set()
        while not stop.is_set():
            ops = next(gen)
            t0 = time.monotonic()
            try:
                results = pool.step(ops)
                error = (
                    ""
                    if results.all_ok
                    else f"refused: {next(r for r in results if not r.ok)}"[:200]
                )
            except Exception as exc:  # noqa: BLE001 - a lost Step is a figure
                error = repr(exc)[:200]
                gen = decode_steps(seqs, seed=int(t0))  # the pool may be a fresh one: start over
            steps.append((t0, time.monotonic() - t0, error))
            time.sleep(STEP_PAUSE_S)
        pool.close()

    def request_loop() -> None:
        with httpx.Client() as client:
            while not stop.is_set():
                t0 = time.monotonic()
                answered_by, error = "", ""
                try:
                    r = client.post(router + "/v1/completions", json=body, timeout=60)
                    answered_by = r.headers.get("x-pagedkv-worker", "")
                    if r.status_code != 200:
                        error = f"{r.status_code}: {r.text[:150]}"
                    elif (text := r.json()["choices"][0]["text"]) != want:
                        error = f"answered {text!r}, not the worker's {want!r}"
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    error = repr(exc)[:200]
                requests.append((t0, time.monotonic() - t0, error, answered_by))
                stop.wait(REQUEST_PAUSE_S)

    threads = [threading.Thread(target=step_loop), threading.Thread(target=request_loop)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    conn.send({"steps": steps, "requests": requests})
    conn.close()


def _window(samples: dict, t0: float, t1: float, workers: set[str]) -> dict:
    steps = [s for s in samples["steps"] if t0 <= s[0] < t1]
    requests = [r for r in samples["requests"] if t0 <= r[0] < t1]
    return {
        "steps": len(steps),
        "step_p99_ms": ms(harness.percentile((s[1] for s in steps), 0.99)),
        "requests": len(requests),
        "request_p99_ms": ms(harness.percentile((r[1] for r in requests), 0.99)),
        "errors": [s[2] for s in steps if s[2]] + [r[2] for r in requests if r[2]],
        "answered_by_others": sum(r[3] not in workers for r in requests if not r[2] or r[3]),
    }


def _stack_run(kind: str, w: AttackWorkload, names: list[str]) -> dict:
    from pagedkv.stack import LocalStack

    credentials = kind == "credentials"
    env = {
        "PAGEDKV_ALLOCATOR_SNAPSHOT_EVERY": str(w.snapshot_every),
        "PAGEDKV_ROUTER_HEADER_TIMEOUT": str(w.router_header_timeout_s),
        "PAGEDKV_ROUTER_BODY_TIMEOUT": str(w.router_body_timeout_s),
        "PAGEDKV_ROUTER_FIRST_BYTE_TIMEOUT": str(w.router_first_byte_timeout_s),
    }
    # the attacker's address, held from now on (its token is bound to it), and the store's folder
    attacker = socket.create_server(("127.0.0.1", 0))
    store_dir = Path(tempfile.mkdtemp(prefix="pagedkv-attacks-store-"))
    attacker_url = f"http://127.0.0.1:{attacker.getsockname()[1]}"
    try:
        with LocalStack(
            2,
            MODEL,
            worker_args=WORKER_ARGS,
            router=True,
            redis=True,
            credentials=credentials,
            guest_workers=[(ATTACKER, attacker_url)] if credentials else (),
            env=env,
            allocator_args=[
                "--kv-shared-store",
                f"file://{store_dir}",
                "--kv-shared-store-size",
                STORE_GIB,
            ],
            startup_timeout=300.0,
        ) as stack:
            return _run_attacks(stack, kind, attacker, store_dir, w, names)
    finally:
        attacker.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def _run_attacks(
    stack, kind: str, attacker: socket.socket, store_dir: Path, w: AttackWorkload, names: list[str]
) -> dict:
    """The victim and each attack in turn against a started
    stack; its rows and the victim's totals."""
    credentials = kind == "credentials"

    def secret(name: str) -> str | None:
        return (Path(stack.log_dir) / name).read_text().strip() if credentials else None

    attacker_key = secret(f"{ATTACKER}.store-key")
    target = Target(
        stack,
        credentials,
        secret("worker-1.token"),
        secret("admin-token"),
        secret(f"{ATTACKER}.token"),
        attacker_key.encode() if attacker_key else None,
        attacker,
        store_dir,
    )
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    mine, theirs = ctx.Pipe(duplex=False)
    victim = ctx.Process(
        target=_victim,
        daemon=True,
        args=(
            target.allocator,
            target.admin_token,
            target.router,
            target.worker,
            w.victim_seqs,
            w.router_max_tokens,
            stop,
            ready,
            theirs,
        ),
    )
    victim.start()
    sampler = Sampler(stack.allocator.pid)
    windows = []
    try:
        if not ready.wait(120):
            raise RuntimeError("the victim did not start")
        for name in names:
            harness.log("attacks", f"{kind}: {name}")
            b0 = time.monotonic()
            time.sleep(w.baseline_s)
            a0 = time.monotonic()
            try:
                with ATTACK_NAMES[name](target, w) as details:
                    time.sleep(w.attack_s)
            except Exception as exc:  # noqa: BLE001 - an attack that broke is reported, the run goes on
                details = {"attack_error": repr(exc)[:300]}
            a1 = time.monotonic()
            alive = {n: p.alive() for n, p in stack.processes.items()}
            windows.append((name, b0, a0, a1, details, alive))
        time.sleep(w.baseline_s)  # the victim's last window after the last attack
    finally:
        stop.set()
        samples = mine.recv() if mine.poll(120) else {"steps": [], "requests": []}
        victim.join(60)
        sampler.stop()
    rows = []
    ours = {worker.worker_id for worker in stack.workers}
    for name, b0, a0, a1, details, alive in windows:
        base, during = _window(samples, b0, a0, ours), _window(samples, a0, a1, ours)
        rss_base, threads_base = sampler.peak(b0, a0)
        rss, threads = sampler.peak(a0, a1)
        reached = details.pop("reached", None)
        refused = details.pop("refused", {})
        died = sorted(n for n, up in alive.items() if not up)
        errors = during["errors"]
        rows.append(
            {
                "attack": name,
                "seconds": round(a1 - a0, 1),
                "baseline": {k: v for k, v in base.items() if k != "errors"},
                "during": {k: v for k, v in during.items() if k != "errors"},
                "allocator_rss_mib_peak": rss,
                "allocator_threads_peak": threads,
                "allocator_rss_mib_baseline": rss_base,
                "allocator_threads_baseline": threads_base,
                "reached": reached,
                "victim_errors": len(errors),
                "errors": errors[:KEPT_ERRORS],
                "exited": died,
                "refused": refused,
                "details": details,
                "succeeded": bool(reached)
                or bool(errors)
                or bool(died)
                or during["answered_by_others"] > 0,
            }
        )
    every = _window(samples, float("-inf"), float("inf"), ours)
    return {
        "attacks": rows,
        "victim": {
            "steps": every["steps"],
            "requests": every["requests"],
            "errors": len(every["errors"]),
            "first_errors": every["errors"][:KEPT_ERRORS],
        },
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    w = ATTACKS[args.workload]
    stacks = {kind: _stack_run(kind, w, args.attacks) for kind in STACKS}
    return {
        "workload": {
            "name": args.workload,
            **{k: v for k, v in asdict(w).items() if k != "what"},
            "what": w.what,
            "model": MODEL,
            "worker_args": WORKER_ARGS,
        },
        "stacks": stacks,
    }
