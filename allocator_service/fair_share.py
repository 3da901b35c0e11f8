"""How pools share one allocator process: the CPU fair share (`FairShare`)
and a bound on each pool's slow calls in flight (`CallSlots`). The servicer
runs every call under both (`rpc/servicer.py`); nothing is ever refused for
the fair share, only for the slots.

**The fair share.** All pools share one interpreter. A pool whose calls are
long and CPU-bound (32k-token admits, integrity checks, dumps of a
65,536-block pool) would otherwise run beside a worker's 0.5 ms decode Step for as long as it likes,
and that Step waits for the interpreter behind it, again and again.

So each call is charged to its tenant (the pool it names; `RegisterPool` to
its worker id; cross-pool router calls to one tenant, `ROUTER`): the CPU
time of the thread that serves it (`time.thread_time`), kept as a sum that
decays with a time constant of `window_s` (the tenant's recent CPU use).
When tenants contend, the one that used more waits for the one that used
less: a call that has run `slice_s` of CPU (its time slice: a short call,
such as a decode Step, never yields), at each pause point of the core
(`core/pause_points.py`, between chunks of work), waits while a call of a
tenant whose recent use is at least `slack_s` lower is in flight, so the
heavy pool yields the interpreter to the light one and runs again once that
call is answered. And while another tenant is active (a call in flight, or
CPU used within the window), a tenant that used over half of the window
waits, before a call and at pause points, until its use decays to half:
a heavy pool leaves the interpreter free for the others' calls as they
arrive, while a fleet of equal pools, each far below half, never waits
for a share. Looking costs O(calls in flight), not O(tenants): the
tenants are scanned only for a pool over half. Like a CPU scheduler's
fair share, nothing is refused and no result changes; a wait lasts at
most `max_wait_s` at a time, and a tenant that waits uses no CPU, so its
recent use falls until it is no longer the heavier one: none can be
starved.

Only pool calls make others wait; a router call does not (it takes every
pool's lock in turn, and a pool waiting at a pause point holds its own).
A call waits only where it holds no lock another pool's call needs: before
it starts, and at pause points inside its own pool's work.

**The slots: one worker cannot take every server thread.** The server
answers unary calls on a fixed pool of threads (`rpc/server.py`). A
pool's reads can be long and are legal (integrity checks, dumps of a large
pool), and the fair share even makes a heavy pool's calls wait while
lighter pools run, each waiting call holding its thread. Without
a bound, one worker that sends many such calls at once holds every thread,
and every other pool's calls queue behind them. So a pool may have at most
`Limits.max_calls_per_pool` of them in flight (GetBlockTable, GetPoolStats,
ResetPrefixCache, DumpPool: `rpc/servicer.SLOTTED`); one more is refused at once
with RESOURCE_EXHAUSTED (`pool_calls`), before any work, and nothing
changes. Only calls with the pool's credential take a slot (it is checked
first), so nobody can use up another pool's slots. The gRPC client backs
off and retries a `pool_calls` refusal like an unreachable server, so a
worker's own burst (its /metrics scraped by several at once) waits rather
than fails. Many pools' slow calls together are bounded too: at most
`Limits.max_slow_calls` over every pool, refused the same way past it, and
the server keeps its threads for short calls (heartbeats, lease renewals,
Steps) apart from those (`rpc/server.py`), so however many pools send slow
reads, none of them waits for a thread behind those reads.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from allocator_service.core.pause_points import pacing
from allocator_service.wire.errors import TooManyCalls

ROUTER = "(router)"
# Windows after which `FairShare` brings its table of recent use to the
# present (exp(50) is far from a float's overflow, and 50 windows of decay
# leave 2e-22 of a tenant's use).
_REBASE = 50.0


class FairShare:
    def __init__(
        self,
        window_s: float = 0.1,
        slack_s: float = 0.002,
        max_wait_s: float = 0.05,
        slice_s: float = 0.01,
        *,
        enabled: bool = True,
        on_long_calls: Callable[[bool], None] | None = None,
        cpu: Callable[[], float] = time.thread_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (window_s > 0 and slack_s >= 0 and max_wait_s > 0 and slice_s >= 0):
            raise ValueError(
                "window_s and max_wait_s must be positive, slack_s and slice_s not negative"
            )
        self.window_s, self.slack_s, self.max_wait_s = window_s, slack_s, max_wait_s
        # The CPU a call runs before it yields to lighter pools' calls (its
        # time slice): longer than a worker's decode Step, so that a fleet's
        # Steps never wait for each other, while a long call (a 32k-token
        # admit, a dump) yields within this much.
        self.slice_s = slice_s
        # Called with True as the first long call begins (one past its
        # slice, or one `call(long=True)` counts so from its start), and
        # with False as the last ends (the server shortens the interpreter's
        # switch interval meanwhile: rpc/server.py).
        self.on_long_calls = on_long_calls
        self._long = 0  # long calls in flight
        # Recent use below this counts as idle (1% of the time).
        self._floor = window_s / 100
        self.enabled = enabled
        self._cpu, self._clock = cpu, clock
        self._cond = threading.Condition(threading.Lock())
        # tenant -> [its recent CPU seconds as of clock time `_base`, clock
        #            time of its last charge].
        # NOTE: every tenant's use decays by the same factor, so the table
        # keeps them all as of one time, `_base`: a tenant's recent use now is
        # its entry times exp((_base - now) / window_s), and comparing two
        # tenants compares their entries (one exp per look at the table, not
        # one per tenant: a call looks at every tenant's use).
        self._use: dict[str, list[float]] = {}
        self._base = clock()
        # tenant -> pool calls in flight (router calls make nobody wait)
        self._running: dict[str, int] = {}
        self._in_flight = 0
        self._pruned_at = clock()
        # What the metrics report (server-wide, so the series stay few).
        self.waiting = 0  # calls waiting now
        self.waits = 0
        self.wait_seconds = 0.0
        self.cpu_seconds = 0.0

    # ------------------------------------------------------------- the rule
    def _growth(self, now: float) -> float:
        """exp((now - _base) / window_s): recent CPU seconds at `now` times
        this are the table's. Past `_REBASE` windows the table is brought to
        `now` first, so the factor stays far from overflow (lock held)."""
        age = (now - self._base) / self.window_s
        if age > _REBASE:
            shrink = math.exp(-age)
            for use in self._use.values():
                use[0] *= shrink
            self._base, age = now, 0.0
        return math.exp(age)

    def _delay(self, tenant: str, yields: bool) -> float:
        """How long `tenant` should wait before it runs on (0: not at all;
        lock held). `yields`: its call is past its time slice (`slice_s`),
        so it yields to a lighter pool's call in flight. It looks at the
        calls in flight (a few), and at every tenant only when `tenant`
        holds over half the interpreter."""
        grow = self._growth(self._clock())
        use = self._use
        entry = use.get(tenant)
        mine = entry[0] if entry is not None else 0.0
        # (in the table's terms: the slack and the half times `grow`)
        lighter_than = mine - self.slack_s * grow
        if yields and lighter_than > 0:
            for t in self._running:
                theirs = use.get(t)
                if t != tenant and (theirs is None or theirs[0] < lighter_than):
                    # A lighter pool's call is in flight: until it is answered (notified).
                    return self.max_wait_s
        # Over half the interpreter while another tenant is active: until its
        # use decays to half. (A tenant using a fraction f of the time settles
        # at f * window; one pool among many equal ones never gets near it.)
        half = self.window_s / 2 * grow
        if mine <= half or not self._others_active(tenant, grow):
            return 0.0
        return self.window_s * math.log(mine / half)

    def _others_active(self, tenant: str, grow: float) -> bool:
        """Whether a tenant but `tenant` has a pool call in flight or used CPU
        within the window (lock held)."""
        floor = self._floor * grow
        return any(t != tenant for t in self._running) or any(
            t != tenant and theirs > floor for t, (theirs, _) in self._use.items()
        )

    def _wait(self, tenant: str, yields: bool) -> None:
        """Wait as `_delay` says, at most `max_wait_s` in all (lock held)."""
        delay = self._delay(tenant, yields)
        if delay <= 0:
            return
        t0 = self._clock()
        waited = 0.0
        self.waiting += 1
        try:
            while delay > 0 and waited < self.max_wait_s:
                self._cond.wait(min(delay, self.max_wait_s - waited))
                waited = self._clock() - t0
                delay = self._delay(tenant, yields)
        finally:
            self.waiting -= 1
        self.waits += 1
        self.wait_seconds += waited

    def _charge(self, tenant: str, seconds: float) -> None:
        """Add `seconds` of CPU to `tenant`'s recent use (lock held)."""
        now = self._clock()
        grow = self._growth(now)
        use = self._use.get(tenant)
        if use is None:
            use = self._use[tenant] = [0.0, now]
        use[0] += seconds * grow
        use[1] = now
        self.cpu_seconds += seconds

    def _forget_idle(self) -> None:
        """Drop tenants with no call in flight whose use has decayed to
        nothing (idle for 10 windows: under 1/20,000 of what it was), so the
        table holds recent tenants only and a lone busy pool's pause points
        take the fast path (lock held; at most once a window)."""
        now = self._pruned_at = self._clock()
        for tenant in [
            t
            for t, (_, charged) in self._use.items()
            if now - charged > 10 * self.window_s and not self._running.get(t)
        ]:
            del self._use[tenant]

    # ------------------------------------------------------------ the calls
    @contextmanager
    def call(self, tenant: str, *, pool_call: bool = True, long: bool = False) -> Iterator[None]:
        """Run one call of `tenant` under the fair share: it may wait before
        it starts and at the core's pause points; its CPU time is charged.
        `long`: a call that may be long (a slow read, a router's call),
        counted as past its slice from its start: many of them, each within
        its slice, would otherwise keep the interpreter in long turns."""
        if not self.enabled:
            yield
            return
        cpu = self._cpu
        mark = [cpu()]
        first = [0.0]  # the call's CPU clock as it started (after any wait)
        past = [long]  # past its slice (or counted so from the start)

        def pace() -> None:
            """At a pause point: charge the CPU so far, then maybe wait."""
            now = cpu()
            if not past[0] and now - first[0] >= self.slice_s:
                past[0] = True
                self._count_long(1)
            if len(self._use) <= 1 and self._in_flight <= self._running.get(tenant, 0):
                return  # no other tenant: nothing to yield to (read without the lock)
            with self._cond:
                self._charge(tenant, now - mark[0])
                self._wait(tenant, past[0])
            mark[0] = cpu()

        with self._cond:
            self._wait(tenant, False)
            if pool_call:
                self._running[tenant] = self._running.get(tenant, 0) + 1
                self._in_flight += 1
        if long:
            self._count_long(1)
        mark[0] = first[0] = cpu()
        try:
            with pacing(pace):
                yield
        finally:
            spent = cpu() - mark[0]
            with self._cond:
                self._charge(tenant, spent)
                if pool_call:
                    self._in_flight -= 1
                    if self._running[tenant] == 1:
                        del self._running[tenant]
                    else:
                        self._running[tenant] -= 1
                    if self.waiting:
                        self._cond.notify_all()
                if self._clock() - self._pruned_at > self.window_s:
                    self._forget_idle()
            if past[0]:
                self._count_long(-1)

    def _count_long(self, change: int) -> None:
        """One more (+1) or one fewer (-1) long call in flight;
        `on_long_calls` hears when there come to be some, or none."""
        with self._cond:
            self._long += change
            if self.on_long_calls is not None and self._long == (1 if change > 0 else 0):
                self.on_long_calls(self._long > 0)

    def recent_cpu(self) -> dict[str, float]:
        """Each tenant's recent CPU seconds (decayed to now)."""
        with self._cond:
            grow = self._growth(self._clock())
            return {t: use / grow for t, (use, _) in self._use.items()}


class CallSlots:
    def __init__(self, per_tenant: int, total: int | None = None) -> None:
        """At most `per_tenant` calls of one tenant in flight, and `total`
        (None: no bound) of all tenants together."""
        if per_tenant < 1 or (total is not None and total < 1):
            raise ValueError("per_tenant and total must be positive")
        self.per_tenant, self.total = per_tenant, total
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._all = 0
        self.refused = 0  # calls refused so far (`pagedkv_allocator_pool_calls_refused_total`)

    @contextmanager
    def take(self, tenant: str) -> Iterator[None]:
        """Hold one of `tenant`'s slots for the call; TooManyCalls when none is free."""
        with self._lock:
            n = self._in_flight.get(tenant, 0)
            if n >= self.per_tenant:
                self.refused += 1
                raise TooManyCalls(
                    f"{n} calls of this pool are in flight, the most one pool may have "
                    "at once: wait for one to be answered"
                )
            if self.total is not None and self._all >= self.total:
                self.refused += 1
                raise TooManyCalls(
                    f"{self._all} slow calls are in flight over every pool, the most the server "
                    "serves at once: wait for one to be answered"
                )
            self._in_flight[tenant] = n + 1
            self._all += 1
        try:
            yield
        finally:
            with self._lock:
                self._all -= 1
                n = self._in_flight[tenant] - 1
                if n:
                    self._in_flight[tenant] = n
                else:
                    del self._in_flight[tenant]

    def in_flight(self, tenant: str | None = None) -> int:
        """`tenant`'s calls in flight (None: every tenant's)."""
        return self._all if tenant is None else self._in_flight.get(tenant, 0)
