"""The per-pool CPU fair share (`allocator_service/fair_share.py`): past its
time slice a pool that used more CPU waits for a lighter pool's call, and
over half the interpreter while pools contend; it is delayed, never
refused, and its answers do not change. The core's long loops reach their
pause points and give the same results with a pacer installed. No
assertion on a duration."""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator_service.client import EmbeddedAllocator, PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import Admit, BlockPool, Fork, Free, PoolConfig
from allocator_service.core.hashing import chain_hashes, root_hash
from allocator_service.core.pause_points import Unpaced, pace, pacing
from allocator_service.core.snapshot import dumps_chunked
from allocator_service.fair_share import FairShare
from tests.support.allocator import as_json, random_steps


def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.005)


class FakeCpu:
    """CPU seconds that advance only when a test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_past_its_time_slice_a_heavier_pools_call_waits_for_a_lighter_pools_call():
    cpu = FakeCpu()
    # A window so long that nothing decays during the test; a wait bound
    # long enough that only the lighter call's end can release the heavy one.
    fair = FairShare(window_s=1000.0, slack_s=0.002, max_wait_s=60.0, slice_s=0.002, cpu=cpu)
    with fair.call("heavy"):
        cpu.now += 100.0  # the heavy pool's recent use: 100 s of CPU (under half the window)
    with fair.call("light"):
        cpu.now += 1.0
    light_in, light_out = threading.Event(), threading.Event()
    progress = []

    def light() -> None:
        with fair.call("light"):
            light_in.set()
            light_out.wait(30)

    def heavy() -> None:
        with fair.call("heavy"):
            progress.append("started")  # a call starts at once
            cpu.now += 0.001
            pace()  # within its time slice (slice_s of CPU): runs on
            progress.append("within its slice")
            cpu.now += 0.001
            pace()  # past it: yields to the lighter pool's call in flight
            progress.append("past its slice")

    a = threading.Thread(target=light)
    a.start()
    assert light_in.wait(30)
    b = threading.Thread(target=heavy)
    b.start()
    _until(lambda: fair.waiting == 1, "waiting")
    assert progress == ["started", "within its slice"]  # held while the lighter call runs
    light_out.set()
    a.join(30)
    b.join(30)
    assert progress == ["started", "within its slice", "past its slice"]  # delayed, never refused
    assert fair.waits == 1 and fair.waiting == 0
    # The lighter pool never waits for the heavier one, past its slice too.
    heavy_in, heavy_out = threading.Event(), threading.Event()

    def heavy_again() -> None:
        with fair.call("heavy"):
            heavy_in.set()
            heavy_out.wait(30)

    c = threading.Thread(target=heavy_again)
    c.start()
    assert heavy_in.wait(30)
    with fair.call("light"):
        cpu.now += 0.01
        pace()
    heavy_out.set()
    c.join(30)
    assert fair.waits == 1


def test_over_its_share_a_pool_waits_at_most_the_bound_and_runs():
    """Two active pools: one with 0.9 of the window's CPU is over half of
    it and waits (bounded by max_wait_s, then it runs); alone it never waits."""
    cpu = FakeCpu()
    fair = FairShare(window_s=1.0, max_wait_s=0.01, cpu=cpu)
    with fair.call("alone"):
        cpu.now += 0.9
    with fair.call("alone"):
        pass
    assert fair.waits == 0  # no other tenant: no share to keep
    with fair.call("other"):
        cpu.now += 0.1
    ran = []
    with fair.call("alone"):
        ran.append(True)
    assert ran == [True] and fair.waits == 1 and fair.wait_seconds > 0
    off = FairShare(enabled=False, cpu=cpu)
    with off.call("x"):
        cpu.now += 5
    with off.call("y"):
        pass
    assert off.waits == 0 and off.recent_cpu() == {}


def test_a_fleet_of_equal_pools_never_waits_for_a_share():
    """32 pools, each a 2 ms call every 80 ms: the interpreter is 80% busy
    and each pool far below half of it, so no call waits (a pool's share
    of 1/33 of the window would hold each one after every call)."""
    cpu, clock = FakeCpu(), FakeClock()
    start = time.monotonic()
    fair = FairShare(
        window_s=0.1,
        max_wait_s=0.01,
        cpu=cpu,
        # the test's clock, and real time too: a wait (were there one) ends
        clock=lambda: clock.now + time.monotonic() - start,
    )
    for _ in range(20):
        for pool in range(32):
            with fair.call(f"pool-{pool}"):
                cpu.now += 0.002
                pace()
            clock.now += 0.0025
    assert fair.waits == 0
    assert len(fair.recent_cpu()) == 32


def test_the_server_hears_when_calls_run_past_their_slice_and_when_none_does():
    """`on_long_calls` (the server shortens the switch interval meanwhile):
    True as the first call passes its slice, False as the last such ends;
    never for calls within their slice; a call that may be long (`long`)
    from its start."""
    cpu, heard = FakeCpu(), []
    fair = FairShare(slice_s=0.01, cpu=cpu, on_long_calls=heard.append)
    with fair.call("steps"):
        cpu.now += 0.009
        pace()
    assert heard == []
    with fair.call("heavy"):
        cpu.now += 0.01
        pace()
        assert heard == [True]
        with fair.call("other heavy"):  # a second one meanwhile: nothing new to hear
            cpu.now += 0.02
            pace()
            pace()
        assert heard == [True]
    assert heard == [True, False]
    with fair.call("reader", long=True):  # a slow read: counted from its start
        assert heard == [True, False, True]
    assert heard == [True, False, True, False]


class FakeClock(FakeCpu):
    """Clock time that advances only when a test says so."""


def _plain_recent(charges: list[tuple[str, float, float]], now: float, window: float) -> dict:
    """Each tenant's recent CPU seconds by the plain rule: every charge
    (tenant, clock time, seconds) decayed on its own to `now`."""
    recent: dict[str, float] = {}
    for tenant, at, seconds in charges:
        recent[tenant] = recent.get(tenant, 0.0) + seconds * math.exp((at - now) / window)
    return recent


@settings(max_examples=100, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "d"]),
            st.integers(0, 300).map(lambda ms: ms / 1000),  # clock seconds before the call
            st.integers(0, 50).map(lambda ms: ms / 1000),  # its CPU seconds
        ),
        min_size=1,
        max_size=40,
    ),
    window=st.sampled_from([0.01, 0.1, 1.0]),
)
def test_recent_use_kept_as_of_one_time_is_each_charge_decayed_on_its_own(calls, window):
    """The table keeps every tenant's use as of one clock time (brought to
    the present now and then): what it reports, and so every wait it decides,
    is the plain rule's, each charge decayed from when it was made."""
    cpu, clock = FakeCpu(), FakeClock()
    fair = FairShare(window_s=window, cpu=cpu, clock=clock)
    # the bookkeeping alone: a wait on a fake clock never ends
    fair._delay = lambda tenant, yields: 0.0
    charges = []
    for tenant, pause, seconds in calls:
        clock.now += pause
        with fair.call(tenant):
            cpu.now += seconds
        charges.append((tenant, clock.now, seconds))
        recent = fair.recent_cpu()
        plain = _plain_recent(charges, clock.now, window)
        assert set(recent) <= set(plain)
        for t, use in recent.items():
            # a tenant idle for 10 windows is forgotten: under e^-10 of what it used
            spent = sum(seconds for who, _, seconds in charges if who == t)
            assert use == pytest.approx(plain[t], rel=1e-9, abs=1e-15 + math.exp(-10) * spent)


def _busy_pool() -> BlockPool:
    pool = BlockPool(PoolConfig(8192, 16, True, "m"))
    tokens = list(range(16 * 2048))
    pool.admit("p", tokens)
    for i in range(3):
        pool.fork("p", f"c{i}")
    pool.admit("q", tokens[:1000])
    pool.free("q")  # cached free blocks too
    return pool


def test_the_cores_long_loops_pause_and_give_the_same_results():
    pool = _busy_pool()
    plain = (
        pool.integrity_problems(),
        dumps_chunked(pool.to_state()),
        chain_hashes(root_hash("m", 16), list(range(16 * 2048)), 16),
    )
    paused = []
    with pacing(lambda: paused.append(1)):
        integrity = pool.integrity_problems()
        after_integrity = len(paused)
        dumped = dumps_chunked(pool.to_state())
        after_dump = len(paused)
        hashes = chain_hashes(root_hash("m", 16), list(range(16 * 2048)), 16)
    assert (integrity, dumped, hashes) == plain
    assert plain[0] == []
    assert after_integrity >= 8192 // 512  # every chunk of the block loops at least
    assert after_dump - after_integrity >= 8192 // 512
    assert len(paused) - after_dump >= 2048 // 64


def test_no_pause_point_waits_under_the_mutation_lock():
    """The service's mutation lock (`Unpaced`): while it is held, the
    holder's pause points do nothing (a pool waiting there would hold up
    every change); after it, they call the pacer again."""
    lock, paused = Unpaced(), []
    with pacing(lambda: paused.append(1)):
        pace()
        with lock:
            pace()
            _busy_pool().integrity_problems()
        pace()
    assert paused == [1, 1]
    assert not lock._lock.locked()


@pytest.fixture(scope="module")
def server(allocator_server):
    with allocator_server("--metrics-port", "0") as s:
        yield s


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^pagedkv_allocator_{name}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"no {name}{labels}"
    return float(m.group(1))


def test_a_heavy_pool_beside_a_light_one_gets_the_same_answers(server):
    """A light pool steps while a heavy one admits long prompts, forks them,
    checks and dumps its pool, over and over, against a server with the fair
    share on. Every answer of both equals the in-process core's, and the
    server charged both pools' CPU (metrics)."""
    heavy_spec = PoolSpec("fair-heavy", PoolConfig(8192, 16, True, "m"))
    light_spec = PoolSpec("fair-light", PoolConfig(64, 4, True, "m"))
    heavy, light = (
        GrpcAllocator(server.address, heavy_spec),
        GrpcAllocator(server.address, light_spec),
    )
    heavy_core, light_core = EmbeddedAllocator(heavy_spec), EmbeddedAllocator(light_spec)
    done = threading.Event()
    light_steps = []

    def light_loop() -> None:
        while not done.is_set():
            for ops in random_steps(seed=len(light_steps), steps=20):
                light_steps.append((light.step(ops), light_core.step(ops)))

    t = threading.Thread(target=light_loop)
    t.start()
    try:
        for r in range(4):
            prompt = [(r * 7919 + i) % 32000 for i in range(16 * 1024)]
            for ops in ([Admit(f"p{r}", prompt)], [Fork(f"p{r}", f"p{r}-c{i}") for i in range(4)]):
                assert heavy.step(ops) == heavy_core.step(ops)
            assert heavy.integrity_problems() == []
            assert heavy.dump() == as_json(heavy_core.pool.to_state())
            ops = [Free(f"p{r}"), *(Free(f"p{r}-c{i}") for i in range(4))]
            assert heavy.step(ops) == heavy_core.step(ops)
    finally:
        done.set()
        t.join(60)
    assert light_steps and all(got == want for got, want in light_steps)
    assert light.dump() == as_json(light_core.pool.to_state())
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    assert _metric(text, "fair_share_cpu_seconds_total") > 0
    assert _metric(text, "fair_share_waiting") == 0
    recent = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r"^pagedkv_allocator_pool_recent_cpu_seconds"
            r'\{pool_id="([^"]+)",worker_id="[^"]+"\} (\S+)$',
            text,
            re.M,
        )
    }
    assert set(recent) >= {heavy.pool_id, light.pool_id}
    print(
        "DRILL",
        json.dumps(
            {
                "fair_share_waits": _metric(text, "fair_share_waits_total"),
                "fair_share_wait_seconds": _metric(text, "fair_share_wait_seconds_total"),
                "light_steps": len(light_steps),
            }
        ),
    )
    heavy.close()
    light.close()
