"""The target as each attack sees it (`Target`), the stack's shape, and the
probes the attacks and the drill share (`Prober`, `Sampler`, `running`)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.bench import harness

MODEL = "tiny-random"
WORKER_ARGS = [
    "--num-blocks",
    "64",
    "--block-size",
    "16",
    "--max-num-seqs",
    "4",
    "--log-level",
    "warning",
]
PROMPT = "Hello there"
STEP_PAUSE_S = 0.02  # between the victim's Steps, as a worker's decode steps come
REQUEST_PAUSE_S = 0.05  # between the victim's router requests
SAMPLE_S = 0.05  # the allocator's RSS and threads read this often
KEPT_ERRORS = 5
METRICS_PROBES = 20  # GETs of the allocator's /metrics before the idle connections and with them
METRICS_PAUSE_S = 0.05
METRICS_TARGET_S = 1.0  # /metrics answers within this with the idle connections open
BLOCK_SIZE = 16  # WORKER_ARGS'
STORE_GIB = "0.0625"  # the stack's shared store (64 MiB; an entry of the tiny model is 8 KiB)
# the attacker's worker id: with credentials its own token, a store group of its own
ATTACKER = "attacker"
# the model the evil worker serves: only the attack's requests are routed to it
EVIL_MODEL = "evil-model"
STORE_MAX_TOKENS = 8  # per completion of the store attacks
TRICKLE_SLACK_S = 5.0  # a trickled answer ended within the router's first-byte timeout and this


@dataclass
class Target:
    stack: Any  # a started LocalStack
    credentials: bool
    worker_token: str | None  # worker-1's (with credentials)
    admin_token: str | None
    attacker_token: str | None  # ATTACKER's worker token (with credentials)
    attacker_key: bytes | None  # ATTACKER's own store group's key (with credentials)
    attacker_socket: socket.socket  # listening at the address ATTACKER's token is bound to
    store_dir: Path  # the shared store's folder (file://), which the attacker can read and write

    @property
    def allocator(self) -> str:
        return self.stack.allocator_address

    @property
    def router(self) -> str:
        return self.stack.router_url

    @property
    def worker(self) -> str:
        return self.stack.worker_urls[0]

    @property
    def writer(self) -> str:  # the worker whose store entries the attacker writes over
        return self.stack.worker_urls[1]

    @property
    def attacker_url(self) -> str:
        return f"http://127.0.0.1:{self.attacker_socket.getsockname()[1]}"


@contextlib.contextmanager
def running(work: Callable[[], dict]) -> Iterator[dict]:
    """An attack that is `work` in a thread while its window lasts (and until it is done);
    its figures, or its exception raised here."""
    out: dict[str, Any] = {}
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["figures"] = work()
        except Exception as exc:  # noqa: BLE001 - raised again in the bench's thread
            done["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        thread.join()
    if "error" in done:
        raise done["error"]
    out.update(done["figures"])


def metric(url: str, name: str) -> float:
    return sum(s.value for s in harness.metric_samples(url) if s.name == name)


class Prober:
    """GET `url` every 50 ms in a thread: failures and the longest wait."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.waits: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Prober:
        self._thread.start()
        return self

    def _run(self) -> None:
        import httpx

        with httpx.Client() as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = client.get(self.url, timeout=30).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.waits.append(time.perf_counter() - t0)
                self.failed += not ok
                self._stop.wait(0.05)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(60)
        return {
            "health_probes": len(self.waits),
            "health_failed": self.failed,
            "health_max_wait_ms": ms(max(self.waits, default=None)),
        }


class Sampler:
    """The allocator's RSS and thread count every SAMPLE_S, as (time, MiB, threads)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._proc = psutil.Process(pid)
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                self.samples.append(
                    (
                        time.monotonic(),
                        self._proc.memory_info().rss / 2**20,
                        self._proc.num_threads(),
                    )
                )
            except psutil.Error:
                return
            self._stop.wait(SAMPLE_S)

    def peak(self, t0: float, t1: float) -> tuple[float | None, int | None]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return None, None
        return round(max(s[1] for s in inside), 1), max(s[2] for s in inside)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)
