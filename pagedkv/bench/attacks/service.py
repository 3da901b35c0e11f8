"""The attacks on the allocator and the router: a rogue pool, idle
connections, slow clients, a big /tokenize, a slow-read flood, snapshot
amplification and snapshot watchers."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from pagedkv.bench import harness
from pagedkv.bench.attacks.target import (
    METRICS_PAUSE_S,
    METRICS_PROBES,
    METRICS_TARGET_S,
    MODEL,
    Prober,
    Target,
    metric,
    ms,
)
from pagedkv.bench.workloads import AttackWorkload


def _refused(err) -> str:
    return err.code().name


@contextlib.contextmanager
def rogue_pool(t: Target, w: AttackWorkload) -> Iterator[dict]:
    import grpc

    from pagedkv.bench.attackers import Attacker, rogue_pool

    out: dict[str, Any] = {}
    refused: Counter[str] = Counter()
    pools = []
    with Attacker(MODEL, relay=t.worker) as relay, Attacker(MODEL) as forger:
        if t.credentials:  # an outsider, then worker-1's token: every one must be refused
            attempts = [
                ("evil", forger.url, MODEL, None),
                ("worker-1", forger.url, MODEL, None),
                ("evil", relay.url, MODEL, t.worker_token),
                ("worker-1", forger.url, MODEL, t.worker_token),
                ("evil", t.worker, MODEL, t.worker_token),
            ]
        else:  # registered: the router must not route to any
            attempts = [
                ("evil-1", t.worker, "other-model", None),
                ("evil-2", t.worker, MODEL, None),
                ("evil-3", relay.url, MODEL, None),
                ("evil-4", forger.url, MODEL, None),
            ]
        for worker_id, url, model, token in attempts:
            try:
                pool = rogue_pool(t.allocator, worker_id, url, model, token)
            except grpc.RpcError as err:
                refused[_refused(err)] += 1
                continue
            pools.append(pool)
            if url == forger.url:
                forger.pool_id = pool.pool_id
        try:
            deadline = time.monotonic() + 30
            while pools and metric(t.router, "pagedkv_router_unproven_pools") < len(pools):
                if time.monotonic() > deadline:
                    out["note"] = "the router did not list every rogue pool within 30 s"
                    break
                time.sleep(0.1)
            yield out
            unproven = metric(t.router, "pagedkv_router_unproven_pools")
        finally:
            for pool in pools:
                pool.close()
        sent = relay.posts + forger.posts
        seen = relay.credentials_seen + forger.credentials_seen
    out.update(
        refused=dict(refused),
        registered=len(pools),
        unproven_pools=unproven,
        completions_sent_to_the_attacker=sent,
        credentials_sent_to_the_attacker=seen,
        reached=sent > 0 or seen > 0,
    )


@contextlib.contextmanager
def idle_connections(t: Target, w: AttackWorkload) -> Iterator[dict]:
    import psutil

    from pagedkv.bench.attackers import TooFewFiles, idle_connections

    proc = psutil.Process(t.stack.allocator.pid)
    url = t.stack.allocator_metrics_url
    before = proc.num_threads()
    metrics_before = _metrics_waits(url)
    out: dict[str, Any] = {}
    try:
        socks = idle_connections(url, w.idle_connections)
    except TooFewFiles as exc:
        out["note"] = str(exc)
        socks = []
    try:
        time.sleep(0.5)
        during = proc.num_threads()
        metrics_during = _metrics_waits(url)
        yield out
    finally:
        for sock in socks:
            sock.close()
    failed = metrics_during.count(None)
    slowest = max((s for s in metrics_during if s is not None), default=None)
    out.update(
        connections=len(socks),
        threads_before=before,
        threads_with_them=during,
        metrics_probes=len(metrics_during),
        metrics_p50_ms_before=ms(harness.percentile(metrics_before, 0.5)),
        metrics_max_ms_before=ms(max((s for s in metrics_before if s is not None), default=None)),
        metrics_p50_ms_during=ms(harness.percentile(metrics_during, 0.5)),
        metrics_max_ms_during=ms(slowest),
        metrics_failed_during=failed,
        # a thread each, or /metrics not answered within METRICS_TARGET_S
        reached=during - before > 16 or failed > 0 or slowest is None or slowest > METRICS_TARGET_S,
    )


def _metrics_waits(url: str, probes: int = METRICS_PROBES) -> list[float | None]:
    """Seconds each of `probes` GETs of `url` took, a new connection each
    (None: not a 200 within 10 s), METRICS_PAUSE_S apart. One client keeps
    no connection: each GET connects anew, and the client's own set-up is
    not timed."""
    import httpx

    waits: list[float | None] = []
    no_keepalive = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(limits=no_keepalive, timeout=10) as client:
        for _ in range(probes):
            t0 = time.perf_counter()
            try:
                ok = client.get(url).status_code == 200
            except httpx.HTTPError:
                ok = False
            waits.append(time.perf_counter() - t0 if ok else None)
            time.sleep(METRICS_PAUSE_S)
    return waits


@contextlib.contextmanager
def slow_clients(t: Target, w: AttackWorkload) -> Iterator[dict]:
    from pagedkv.bench.attackers import closed_by_peer, slow_clients

    t0 = time.monotonic()
    heads, bodies = slow_clients(t.router, w.slow_clients, w.slow_clients)
    out: dict[str, Any] = {}
    health = Prober(t.router + "/health").start()
    try:
        yield out
        # the bodies' deadline checked too when it is
        # near (each open past its deadline and a second)
        body_check = w.router_header_timeout_s + w.router_body_timeout_s + 1.0
        if body_check <= 3 * w.attack_s:
            time.sleep(max(0.0, t0 + body_check + 0.1 - time.monotonic()))
        waited = time.monotonic() - t0

        def still_open(socks, deadline_s: float) -> int | None:
            # None: the attack ended before the deadline
            return sum(not closed_by_peer(s) for s in socks) if waited > deadline_s + 1.0 else None

        open_heads = still_open(heads, w.router_header_timeout_s)
        open_bodies = still_open(bodies, w.router_header_timeout_s + w.router_body_timeout_s)
    finally:
        probes = health.stop()
        for sock in heads + bodies:
            sock.close()
    out.update(
        heads=len(heads),
        bodies=len(bodies),
        heads_open_past_deadline=open_heads,
        bodies_open_past_deadline=open_bodies,
        **probes,
        reached=bool(open_heads) or bool(open_bodies) or probes["health_failed"] > 0,
    )


@contextlib.contextmanager
def big_tokenize(t: Target, w: AttackWorkload) -> Iterator[dict]:
    import httpx

    from pagedkv.bench.attackers import big_text

    answer: dict[str, Any] = {}
    text = big_text(w.tokenize_bytes)

    def post() -> None:
        try:
            r = httpx.post(
                t.worker + "/tokenize",
                json={"prompt": text, "return_token_strs": True},
                timeout=600,
            )
            answer.update(
                status=r.status_code, tokens=r.json().get("count") if r.status_code == 200 else None
            )
        except httpx.HTTPError as exc:
            answer.update(status=None, error=repr(exc)[:200])

    health = Prober(t.worker + "/health").start()
    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    out: dict[str, Any] = {}
    try:
        yield out
    finally:
        thread.join(600)
        probes = health.stop()
    out.update(
        text_bytes=len(text),
        tokenize_status=answer.get("status"),
        tokens=answer.get("tokens"),
        **probes,
        reached=probes["health_failed"] > 0,
    )


@contextlib.contextmanager
def slow_read_flood(t: Target, w: AttackWorkload) -> Iterator[dict]:
    from pagedkv.bench.attackers import slow_read_flood

    ctx = mp.get_context("spawn")
    stop, ready, outcome = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(
        target=slow_read_flood,
        args=(t.allocator, stop, ready),
        daemon=True,
        kwargs={
            "pools": w.flood_pools,
            "in_flight": w.flood_in_flight,
            "blocks": w.flood_blocks,
            "tokens": w.flood_tokens,
            "outcome": outcome,
        },
    )
    proc.start()
    out: dict[str, Any] = {}
    try:
        ready.wait(300)
        yield out
    finally:
        stop.set()
        try:
            got = outcome.get(timeout=120)
        except Exception:  # noqa: BLE001 - the flood's process died: say so
            got = {"registered": None, "codes": {"no outcome": 1}}
        proc.join(60)
    codes = got["codes"]
    out.update(
        pools=got["registered"],
        checks_answered=codes.get("OK", 0),
        checks_refused=sum(v for k, v in codes.items() if k not in ("OK",) and " " not in k),
        refused={
            k.removeprefix("RegisterPool "): v
            for k, v in codes.items()
            if k.startswith("RegisterPool")
        },
        reached=False,
    )


@contextlib.contextmanager
def snapshot_amplification(t: Target, w: AttackWorkload) -> Iterator[dict]:
    import grpc

    from allocator_service.client import PoolLost
    from allocator_service.core import Append
    from pagedkv.bench.attackers import snapshot_amplifier

    out: dict[str, Any] = {}
    refused: Counter[str] = Counter()
    pool = None
    try:
        pool, outcomes = snapshot_amplifier(
            t.allocator, steps=w.snapshot_steps, forks=w.snapshot_forks
        )
        out["operations"] = dict(outcomes)
    except grpc.RpcError as err:
        refused[_refused(err)] += 1
    try:
        yield out
    finally:
        if pool is not None:
            try:  # a pool over its snapshot share is dropped: its next call finds it gone
                pool.step([Append("x" * 256, [1])])
                out["dropped"] = False
            except PoolLost:
                out["dropped"] = True
            pool.close()
    out.update(refused=dict(refused), reached=False)


@contextlib.contextmanager
def snapshot_watchers(t: Target, w: AttackWorkload) -> Iterator[dict]:
    import grpc

    from allocator_service.client import PoolSpec
    from allocator_service.client.grpc_client import GrpcAllocator
    from allocator_service.core import Admit, PoolConfig
    from pagedkv.bench.attackers import SnapshotWatchers

    out: dict[str, Any] = {}
    bait = None
    try:  # the cached blocks the watchers' snapshots carry
        blocks = w.watched_tokens // 16 + 16
        bait = GrpcAllocator(
            t.allocator, PoolSpec("watched", PoolConfig(blocks, 16, True, "m")), retries=0
        )
        bait.step([Admit("w", list(range(1, w.watched_tokens + 1)))])
        out["cached_blocks"] = w.watched_tokens // 16
    except grpc.RpcError as err:
        out["pool_refused"] = _refused(err)
    watchers = SnapshotWatchers(t.allocator, w.watchers).start()
    try:
        yield out
    finally:
        got = watchers.stop()
        if bait is not None:
            bait.close()
    codes = got["codes"]
    out.update(
        watchers=w.watchers,
        messages=got["messages"],
        snapshots_read=got["snapshots_ended"],
        refused={k: v for k, v in codes.items() if k != "OK"},
        reached=False,
    )
