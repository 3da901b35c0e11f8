"""`pagedkv up`: the docker-compose topology as local processes.

One allocator (gRPC, in-memory state unless told otherwise), N workers serving
the OpenAI-style HTTP API, and optionally a Redis for the allocator's journal
(`--redis`) and a Prometheus scraping everything (`--prometheus`) when their
binaries are on PATH. Each process's output is echoed with a coloured name
prefix (but for the access-log lines of /health and /metrics) and kept in
`<log dir>/<name>.log`; `pagedkv up` returns when you press
Ctrl-C (or send SIGTERM): workers first, then Prometheus, the allocator and
Redis get SIGTERM, and whatever is still alive after the grace period gets
SIGKILL (a second Ctrl-C skips the grace period).

Library use (tests, the demo)::

    from pagedkv.up import LocalStack

    with LocalStack(workers=2, model="tiny-random", worker_args=["--num-blocks", "128"]) as stack:
        stack.worker_urls            # ["http://127.0.0.1:PORT", ...]: /v1/..., /health, /metrics
        stack.allocator_address      # "127.0.0.1:PORT" (gRPC)
        stack.allocator_metrics_url  # "http://127.0.0.1:PORT/metrics"
        stack.prometheus_url         # "http://127.0.0.1:PORT", or None (not asked for / no binary)
        stack.redis_url              # "redis://127.0.0.1:PORT/0", or None
        stack.logs("worker-1")       # that process's last output lines

- Every port defaults to a free one in the library (0); the CLI defaults to
  fixed ports (workers 8001, 8002, ...; allocator 50051) like docker-compose.
- `__enter__` returns once every process is healthy (gRPC health for the
  allocator, GET /health for workers, /-/ready for Prometheus, PING for Redis)
  or raises `StackError` naming the process that failed, with its last lines;
  nothing is left running then, and a temporary log folder is kept for a
  look (`stack.log_dir`). `__exit__` stops everything; `logs()` works until then.
- `redis=True` / `prometheus=True` without the binary: a warning, and the
  stack runs without it (`redis_url` / `prometheus_url` are None).
- Processes run in their own sessions (a Ctrl-C reaches only this launcher,
  which stops them in order) and on Linux are also told to die with the
  thread that started them, so even a killed launcher leaves no orphans:
  start the stack from a thread that outlives it (normally the main thread).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from pagedkv.cli import CliError

_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")

# Run a command with PR_SET_PDEATHSIG (1) = SIGTERM, so it dies with the launcher.
_EXEC_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


# Access-log lines of health probes and scrapes: kept in the log file, not echoed.
_QUIET_LINE = re.compile(r'"GET /(health|metrics) HTTP/')


class StackError(CliError):
    """A process of the stack failed to start or died; the message names it."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


# ---------------------------------------------------------------- health probes


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET `url` answers 2xx."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (OSError, urllib.error.URLError, ValueError):
        return False


def grpc_health_ok(address: str, timeout: float = 2.0, service: str = "") -> bool:
    """True when the standard gRPC health service at `address` says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def redis_ping_ok(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def prometheus_config(allocator_targets: Sequence[str], worker_targets: Sequence[str],
                      scrape_interval: str = "5s") -> str:
    """A Prometheus config with the job names docker-compose and the dashboard use."""
    def job(name: str, targets: Sequence[str]) -> str:
        listed = ", ".join(f'"{t}"' for t in targets)
        return f"  - job_name: {name}\n    static_configs:\n      - targets: [{listed}]\n"

    return (
        f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
        "scrape_configs:\n"
        + job("pagedkv-allocator", allocator_targets)
        + job("pagedkv-worker", worker_targets)
    )


# ---------------------------------------------------------------- processes


class Process:
    """One child process: own session, output kept (tail + log file) and optionally echoed."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, colour: str,
                 console=None, env: dict[str, str] | None = None, tail_lines: int = 40) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self._console = console
        self._colour = colour
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        launch = self.argv
        if sys.platform.startswith("linux"):
            launch = [sys.executable, "-c", _EXEC_WITH_PARENT, str(os.getpid()), *self.argv]
        self._log = open(log_path, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed by the reader
        try:
            self.popen = subprocess.Popen(
                launch, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, env=full_env,
            )
        except OSError:
            self._log.close()
            raise
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        from rich.text import Text

        assert self.popen.stdout is not None
        try:
            for raw in iter(self.popen.stdout.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self.tail.append(line)
                self._log.write(line + "\n")
                if self._console is not None and not _QUIET_LINE.search(line):
                    self._console.print(
                        Text.assemble((f"{self.name:>10} | ", self._colour), line),
                        markup=False, highlight=False, soft_wrap=True,
                    )
        finally:
            self.popen.stdout.close()
            self._log.close()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def describe_failure(self, what: str) -> str:
        self._reader.join(timeout=1.0)  # let the last lines arrive
        lines = "\n".join(f"    {line}" for line in list(self.tail)[-20:]) or "    (no output)"
        return f"{self.name} {what}; its last lines ({self.log_path}):\n{lines}"

    def finish(self) -> None:
        self._reader.join(timeout=2.0)


def stop_processes(tiers: Sequence[Sequence[Process]], grace: float, hurry: threading.Event | None = None) -> None:
    """SIGTERM each tier's process groups, SIGKILL what outlives `grace` seconds, tier by tier."""
    hurry = hurry or threading.Event()
    for tier in tiers:
        for p in tier:
            if p.alive():
                p.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        try:
            while any(p.alive() for p in tier) and time.monotonic() < deadline and not hurry.is_set():
                time.sleep(0.05)
        except KeyboardInterrupt:
            hurry.set()
        for p in tier:
            p.signal_group(signal.SIGKILL)  # also reaches grandchildren left in the group
            p.popen.wait()
            p.finish()


def wait_healthy(checks: Sequence[tuple[Process, Callable[[], bool]]], timeout: float) -> None:
    """Wait until every check passes; StackError names a process that died or never got healthy."""
    pending = list(checks)
    deadline = time.monotonic() + timeout
    while pending:
        for proc, check in list(pending):
            if not proc.alive():
                raise StackError(proc.describe_failure(
                    f"exited with status {proc.popen.returncode} before it was healthy"))
            if check():
                pending.remove((proc, check))
        if not pending:
            return
        if time.monotonic() > deadline:
            raise StackError("\n".join(
                p.describe_failure(f"was not healthy after {timeout:g} s") for p, _ in pending))
        time.sleep(0.2)


class LocalStack:
    """Allocator + N workers (+ Redis, + Prometheus) as local processes; see the module docstring."""

    def __init__(
        self,
        workers: int = 2,
        model: str = "smollm2",
        *,
        worker_args: Sequence[str] = (),
        allocator_args: Sequence[str] = (),
        state: str = "memory",
        redis: bool = False,
        prometheus: bool = False,
        host: str = "127.0.0.1",
        base_port: int = 0,
        allocator_port: int = 0,
        allocator_metrics_port: int = 0,
        prometheus_port: int = 0,
        scrape_interval: str = "2s",
        startup_timeout: float = 300.0,
        grace: float = 10.0,
        log_dir: str | os.PathLike | None = None,
        echo: bool = False,
    ) -> None:
        if workers < 1:
            raise StackError("--workers must be at least 1")
        if redis and state != "memory":
            raise StackError(f"--redis starts its own Redis; it cannot be combined with --state {state}")
        self.workers = workers
        self.model = model
        self.worker_args = list(worker_args)
        self.allocator_args = list(allocator_args)
        self.state = state
        self.want_redis = redis
        self.want_prometheus = prometheus
        self.host = host
        self.connect_host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        self.base_port = base_port
        self.allocator_port = allocator_port
        self.allocator_metrics_port = allocator_metrics_port
        self.prometheus_port = prometheus_port
        self.scrape_interval = scrape_interval
        self.startup_timeout = startup_timeout
        self.grace = grace
        self._own_log_dir = log_dir is None
        self.failed = False  # a failed stack keeps even a temporary log folder
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.echo = echo
        self.console = None
        self.processes: dict[str, Process] = {}
        self.hurry = threading.Event()  # set it to skip the grace period of a running stop()
        self.worker_urls: list[str] = []
        self.allocator_address: str | None = None
        self.allocator_metrics_url: str | None = None
        self.prometheus_url: str | None = None
        self.redis_url: str | None = None
        self.warnings: list[str] = []

    # -------------------------------------------------------------- lifecycle

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalStack:
        from rich.console import Console

        self.console = Console(highlight=False) if self.echo else None
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="pagedkv-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException as exc:
            self.failed = isinstance(exc, StackError) and bool(self.processes)
            self.stop()
            raise
        return self

    def _port(self, port: int, name: str) -> int:
        if port == 0:
            return free_port(self.connect_host)
        if _port_in_use(self.connect_host, port):
            raise StackError(f"port {port} for {name} is already in use (pass 0 to pick a free port)")
        return port

    def _spawn(self, name: str, argv: Sequence[str]) -> Process:
        colour = _COLOURS[len(self.processes) % len(_COLOURS)]
        proc = Process(name, argv, self.log_dir / f"{name}.log", colour, console=self.console)
        self.processes[name] = proc
        return proc

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        if self.console is not None:
            self.console.print(f"[yellow]warning:[/] {message}", highlight=False)

    def _start(self) -> None:
        h = self.connect_host
        state = self.state
        if self.want_redis:
            redis_bin = shutil.which("redis-server")
            if redis_bin is None:
                self._warn("--redis: no redis-server on PATH; the allocator keeps its state in memory")
            else:
                port = free_port(h)
                data = self.log_dir / "redis"
                data.mkdir(exist_ok=True)
                proc = self._spawn("redis", [redis_bin, "--port", str(port), "--bind", h, "--dir", str(data),
                                             "--appendonly", "yes", "--save", ""])
                wait_healthy([(proc, lambda: redis_ping_ok(h, port))], self.startup_timeout)
                self.redis_url = state = f"redis://{h}:{port}/0"

        aport = self._port(self.allocator_port, "the allocator")
        mport = self._port(self.allocator_metrics_port, "the allocator's metrics")
        self.allocator_address = f"{h}:{aport}"
        self.allocator_metrics_url = f"http://{h}:{mport}/metrics"
        alloc = self._spawn("allocator", [
            sys.executable, "-m", "allocator_service", "--listen", f"{self.host}:{aport}",
            "--metrics-port", str(mport), "--state", state, *self.allocator_args,
        ])
        wait_healthy([(alloc, lambda: grpc_health_ok(self.allocator_address))], self.startup_timeout)

        checks = []
        for i in range(1, self.workers + 1):
            name = f"worker-{i}"
            port = self._port(self.base_port + i - 1 if self.base_port else 0, name)
            url = f"http://{h}:{port}"
            self.worker_urls.append(url)
            proc = self._spawn(name, [
                sys.executable, "-m", "worker", "--model", self.model, "--allocator", self.allocator_address,
                "--worker-id", name, "--host", self.host, "--port", str(port), *self.worker_args,
            ])
            checks.append((proc, lambda url=url: http_ok(f"{url}/health")))

        if self.want_prometheus:
            prom_bin = shutil.which("prometheus")
            if prom_bin is None:
                self._warn("--prometheus: no prometheus binary on PATH; running without it")
            else:
                pport = self._port(self.prometheus_port, "Prometheus")
                config = self.log_dir / "prometheus.yml"
                config.write_text(prometheus_config(
                    [f"{h}:{mport}"], [u.removeprefix("http://") for u in self.worker_urls], self.scrape_interval))
                self.prometheus_url = f"http://{h}:{pport}"
                proc = self._spawn("prometheus", [
                    prom_bin, f"--config.file={config}", f"--storage.tsdb.path={self.log_dir / 'prometheus-data'}",
                    f"--web.listen-address={h}:{pport}", "--log.level=warn",
                ])
                checks.append((proc, lambda: http_ok(f"{self.prometheus_url}/-/ready")))
        wait_healthy(checks, self.startup_timeout)

    def stop(self) -> None:
        """Stop every process (workers and Prometheus, then the allocator, then Redis). Idempotent."""
        p = self.processes
        tiers = [
            [v for k, v in p.items() if k.startswith("worker-") or k == "prometheus"],
            [p[k] for k in ("allocator",) if k in p],
            [p[k] for k in ("redis",) if k in p],
        ]
        try:
            stop_processes(tiers, self.grace, self.hurry)
        finally:
            self.processes = {}
            if self._own_log_dir and self.log_dir is not None and not self.failed:
                shutil.rmtree(self.log_dir, ignore_errors=True)
                self.log_dir = None

    # -------------------------------------------------------------- inspection

    def logs(self, name: str) -> list[str]:
        """The last output lines of process `name` ("allocator", "worker-1", "redis", "prometheus")."""
        return list(self.processes[name].tail)

    def wait(self) -> Process:
        """Block until some process exits, and return it (a healthy stack never returns)."""
        while True:
            for proc in self.processes.values():
                if not proc.alive():
                    return proc
            time.sleep(0.2)

    def describe(self) -> dict:
        return {
            "allocator": self.allocator_address,
            "allocator_metrics": self.allocator_metrics_url,
            "workers": list(self.worker_urls),
            "prometheus": self.prometheus_url,
            "redis": self.redis_url,
            "pids": {name: proc.pid for name, proc in self.processes.items()},
            "log_dir": str(self.log_dir) if self.log_dir else None,
        }


# ---------------------------------------------------------------- CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "up", help="run the allocator and N workers (+ Redis, Prometheus) as local processes",
        description="The docker-compose topology as local processes, with prefixed logs; Ctrl-C stops it all.",
    )
    p.add_argument("--workers", type=int, default=2, help="number of worker processes (default: 2)")
    p.add_argument("--model", default="smollm2", help="model every worker serves: smollm2, tiny-random or a path (default: smollm2)")
    p.add_argument("--host", default="127.0.0.1", help="address the allocator and workers bind (default: 127.0.0.1)")
    p.add_argument("--base-port", type=int, default=8001, help="HTTP port of worker 1; worker i gets base+i-1; 0 picks free ports (default: 8001)")
    p.add_argument("--allocator-port", type=int, default=50051, help="gRPC port of the allocator; 0 picks a free one (default: 50051)")
    p.add_argument("--allocator-metrics-port", type=int, default=9400, help="Prometheus /metrics port of the allocator; 0 picks a free one (default: 9400)")
    p.add_argument("--state", default="memory", help="allocator state: memory or redis://host:port/db (default: memory)")
    p.add_argument("--redis", action="store_true", help="start a redis-server (append-only, on a free port) when the binary exists and keep the allocator's journal in it")
    p.add_argument("--prometheus", action="store_true", help="start a prometheus (when the binary exists) scraping the allocator and every worker")
    p.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus web port; 0 picks a free one (default: 9090)")
    p.add_argument("--scrape-interval", default="2s", help="Prometheus scrape interval (default: 2s)")
    pool = p.add_argument_group("worker settings passed through to every worker")
    pool.add_argument("--num-blocks", type=int, help="KV blocks per worker pool")
    pool.add_argument("--kv-cache-memory", help="KV pool size per worker instead of --num-blocks, e.g. 2GiB")
    pool.add_argument("--block-size", type=int, help="tokens per KV block")
    pool.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                      help="share cached prompt prefixes between requests (default: on)")
    pool.add_argument("--device", help="cpu or cuda")
    pool.add_argument("--dtype", help="model and KV dtype, e.g. float32, bfloat16")
    pool.add_argument("--max-num-seqs", type=int, help="most sequences in one running batch")
    pool.add_argument("--max-num-batched-tokens", type=int, help="most tokens in one scheduler step")
    pool.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                      help="any other worker flag, once per word: --worker-arg=--seed --worker-arg=1")
    p.add_argument("--allocator-arg", action="append", default=[], metavar="ARG",
                   help="any other allocator flag, once per word: --allocator-arg=--lease-ttl --allocator-arg=30")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each stage may take to become healthy (default: 300)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL at shutdown (default: 10)")
    p.add_argument("--log-dir", help="keep each process's log as DIR/NAME.log (default: a temporary folder, removed at exit)")
    p.add_argument("--ready-file", help="when everything is healthy, write the addresses and pids there as JSON")
    p.add_argument("--quiet", action="store_true", help="do not echo the processes' output (it still goes to the log files)")
    return p


def worker_args_from(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for flag in ("num_blocks", "kv_cache_memory", "block_size", "device", "dtype", "max_num_seqs",
                 "max_num_batched_tokens"):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    if args.enable_prefix_caching:
        out.append("--enable-prefix-caching")
    return out + list(args.worker_arg)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    stack = LocalStack(
        workers=args.workers, model=args.model, worker_args=worker_args_from(args),
        allocator_args=args.allocator_arg, state=args.state, redis=args.redis, prometheus=args.prometheus,
        host=args.host, base_port=args.base_port, allocator_port=args.allocator_port,
        allocator_metrics_port=args.allocator_metrics_port, prometheus_port=args.prometheus_port,
        scrape_interval=args.scrape_interval, startup_timeout=args.timeout, grace=args.grace,
        log_dir=args.log_dir, echo=not args.quiet,
    )
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if stopping:  # a second Ctrl-C / SIGTERM: no more grace period
            stack.hurry.set()
            return
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    status = 0
    try:
        stack.start()
        table = Table(title="pagedkv up: all healthy", title_justify="left")
        for col in ("process", "pid", "address"):
            table.add_column(col)
        procs = stack.processes
        table.add_row("allocator", str(procs["allocator"].pid),
                      f"grpc {stack.allocator_address}  metrics {stack.allocator_metrics_url}")
        for i, url in enumerate(stack.worker_urls, 1):
            table.add_row(f"worker-{i}", str(procs[f"worker-{i}"].pid), f"{url}/v1  {url}/metrics")
        if stack.redis_url:
            table.add_row("redis", str(procs["redis"].pid), stack.redis_url)
        if stack.prometheus_url:
            table.add_row("prometheus", str(procs["prometheus"].pid), stack.prometheus_url)
        console.print(table)
        console.print(f"logs: {stack.log_dir}   Ctrl-C stops everything")
        if args.ready_file:
            Path(args.ready_file).write_text(json.dumps(stack.describe(), indent=2))
        dead = stack.wait()
        stopping = True
        stack.failed = True
        raise StackError(dead.describe_failure(f"exited with status {dead.popen.returncode}"))
    except KeyboardInterrupt:
        stopping = True
        console.print("[bold]stopping[/] (Ctrl-C again to skip the grace period)")
    except StackError as exc:
        stopping = True
        console.print(Text.assemble(("pagedkv up: error: ", "bold red"), str(exc)))
        status = 1
    finally:
        stopping = True
        stack.stop()
    console.print("all processes stopped" + (f"; logs kept in {stack.log_dir}" if stack.failed else ""))
    return status
