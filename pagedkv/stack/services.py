"""The processes of the topology: Redis, the allocator, workers, the router and Prometheus.

Each is a `Service`: made with its settings, then `start()`ed (a new
`Process`), `wait_healthy()`, and `kill()`ed (SIGKILL: a crash) or
`terminate()`d (SIGTERM, then SIGKILL after a grace period). `start()` again
runs it anew on the same address with the same data directory and appends to
the same log, which is what the fault drills do.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pagedkv.stack.probes import free_port, grpc_health_ok, http_ok, redis_ping_ok
from pagedkv.stack.process import Process, StackError, stop_processes, wait_healthy

# What the allocator prints once it serves (allocator_service/rpc/server.py).
_LISTENING = re.compile(r"listening on (\S+):(\d+) ")
_METRICS = re.compile(r"metrics on (http://\S+)")


class Service:
    """A named process that can be started, probed, stopped and started again in place."""

    def __init__(
        self,
        name: str,
        *,
        log_path: Path | None = None,
        console=None,
        colour: str = "cyan",
        env: dict[str, str] | None = None,
        die_with_parent: bool = False,
        tail_lines: int = 500,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self.console = console
        self.colour = colour
        self.env = env
        # Off by default: a test may restart a service from a thread that ends first.
        self.die_with_parent = die_with_parent
        self.tail_lines = tail_lines
        self.proc: Process | None = None
        self.starts = 0
        self.started_at = 0.0  # time.monotonic() of the last start

    def argv(self) -> list[str]:
        raise NotImplementedError

    def healthy(self) -> bool:
        raise NotImplementedError

    def _on_line(self, line: str) -> None:
        """Each output line as it comes (the allocator reads its address from them)."""

    def start(self) -> Service:
        argv = self.argv()
        self.starts += 1
        if self.starts > 1 and self.log_path is not None:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(f"---- start {self.starts}\n")
        self.proc = Process(
            self.name,
            argv,
            self.log_path,
            self.colour,
            console=self.console,
            env=self.env,
            tail_lines=self.tail_lines,
            die_with_parent=self.die_with_parent,
            append=self.starts > 1,
            on_line=self._on_line,
        )
        self.started_at = time.monotonic()
        return self

    def wait_healthy(self, timeout: float = 120.0) -> Service:
        """Until `healthy()`; StackError (with its last lines) when it exits or times out first."""
        wait_healthy([(self.proc, self.healthy)], timeout, interval=0.05)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    @property
    def lines(self) -> list[str]:
        """The last output lines of the current run."""
        return list(self.proc.tail) if self.proc is not None else []

    def log(self) -> str:
        """Everything it printed, every start (the log file), else the last lines."""
        if self.log_path is not None and self.log_path.exists():
            return self.log_path.read_text(errors="replace")
        return "\n".join(self.lines)

    def kill(self) -> None:
        """SIGKILL: a crash; no shutdown code runs."""
        if self.proc is not None:
            self.proc.kill()

    def terminate(self, grace: float = 15.0) -> int | None:
        """SIGTERM, SIGKILL after `grace` seconds; the exit status."""
        if self.proc is None:
            return None
        stop_processes([[self.proc]], grace)
        return self.proc.popen.returncode

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()


class AllocatorProcess(Service):
    """`python -m allocator_service --listen LISTEN ARGS...`; healthy once it says it listens
    (and, for a plaintext one asked to `probe_grpc`, once gRPC health says SERVING)."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        listen: str = "127.0.0.1:0",
        connect_host: str | None = None,
        probe_grpc: bool = False,
        name: str = "allocator",
        **kw,
    ) -> None:
        super().__init__(name, **kw)
        self.args = list(args)
        self.listen = listen
        self.connect_host = connect_host
        self.probe_grpc = probe_grpc
        self.host: str | None = None
        self.port: int | None = None
        self.metrics_url: str | None = None
        self._listening = threading.Event()

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "allocator_service", "--listen", self.listen, *self.args]

    @property
    def address(self) -> str:
        return f"{self.connect_host or self.host}:{self.port}"

    def start(self) -> AllocatorProcess:
        self._listening.clear()
        return super().start()

    def _on_line(self, line: str) -> None:
        if (m := _METRICS.search(line)) is not None:
            self.metrics_url = m.group(1)
        if not self._listening.is_set() and (m := _LISTENING.search(line)) is not None:
            self.host, self.port = m.group(1), int(m.group(2))
            self._listening.set()

    def healthy(self) -> bool:
        return self._listening.is_set() and (not self.probe_grpc or grpc_health_ok(self.address))


class RedisProcess(Service):
    """A private `redis-server` with append-only persistence (as a production journal store
    runs), in `data_dir` (default: a temporary one, removed by `stop()`)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        data_dir: Path | None = None,
        name: str = "redis",
        **kw,
    ) -> None:
        super().__init__(name, **kw)
        self.host = host
        self.port = port or free_port(host)
        self._own_dir = data_dir is None
        self.dir = (
            Path(tempfile.mkdtemp(prefix="pagedkv-redis-")) if data_dir is None else Path(data_dir)
        )
        self.url = f"redis://{host}:{self.port}/0"

    def argv(self) -> list[str]:
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed")
        self.dir.mkdir(parents=True, exist_ok=True)
        return [
            exe,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--daemonize",
            "no",
        ]

    def healthy(self) -> bool:
        return redis_ping_ok(self.host, self.port)

    def halt(self) -> None:
        """SIGTERM (it flushes its append-only file) but keep the directory, so
        `start()` brings the same data back."""
        self.terminate(grace=10.0)

    def stop(self) -> None:
        self.halt()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.stop()


class HttpService(Service):
    """A process of ours serving HTTP (a worker, the router): `python -m MODULE` with its model,
    allocator and ARGS, on `host:port` (a free port
    when 0); healthy when GET /health answers 2xx."""

    module = ""

    def __init__(
        self,
        name: str,
        *,
        model: str | None = None,
        allocator: str | None = None,
        args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        connect_host: str | None = None,
        **kw,
    ) -> None:
        super().__init__(name, **kw)
        self.model = model
        self.allocator = allocator
        self.args = list(args)
        self.host = host
        self.port = port or free_port(connect_host or host)
        self.url = f"http://{connect_host or host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", self.module]
        if self.model is not None:
            argv += ["--model", self.model]
        if self.allocator is not None:
            argv += ["--allocator", self.allocator]
        return argv + self.own_args() + self.args

    def own_args(self) -> list[str]:
        return []

    def healthy(self) -> bool:
        return http_ok(f"{self.url}/health")


class WorkerProcess(HttpService):
    """`python -m worker [--model M] [--allocator A] --worker-id NAME --host H --port P
    --advertise-url URL ARGS...`; healthy when GET /health answers."""

    module = "worker"

    def __init__(self, name: str, **kw) -> None:
        super().__init__(name, **kw)
        self.worker_id = name

    def own_args(self) -> list[str]:
        argv = ["--worker-id", self.worker_id, "--host", self.host, "--port", str(self.port)]
        if "--advertise-url" not in self.args:  # so a router finds it through the allocator
            argv += ["--advertise-url", self.url]
        return argv


class RouterProcess(HttpService):
    """`python -m router [--model M] [--allocator A] --listen H:P ARGS...`; healthy when GET
    /health answers 200 (it knows at least one worker)."""

    module = "router"

    def __init__(self, name: str = "router", **kw) -> None:
        super().__init__(name, **kw)

    def own_args(self) -> list[str]:
        return ["--listen", f"{self.host}:{self.port}"]


def prometheus_config(
    allocator_targets: Sequence[str],
    worker_targets: Sequence[str],
    scrape_interval: str = "5s",
    router_targets: Sequence[str] = (),
) -> str:
    """A Prometheus config with the job names docker-compose and the dashboard use."""

    def job(name: str, targets: Sequence[str]) -> str:
        listed = ", ".join(f'"{t}"' for t in targets)
        return f"  - job_name: {name}\n    static_configs:\n      - targets: [{listed}]\n"

    return (
        f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
        "scrape_configs:\n"
        + job("pagedkv-allocator", allocator_targets)
        + job("pagedkv-worker", worker_targets)
        + (job("pagedkv-router", router_targets) if router_targets else "")
    )


class PrometheusProcess(Service):
    """`prometheus` with a generated config scraping the
    allocator and the workers; healthy at /-/ready."""

    def __init__(
        self,
        exe: str,
        config: Path,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "prometheus",
        **kw,
    ) -> None:
        super().__init__(name, **kw)
        self.exe = exe
        self.config = config
        self.data_dir = data_dir
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        return [
            self.exe,
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.data_dir}",
            f"--web.listen-address={self.host}:{self.port}",
            "--log.level=warn",
        ]

    def healthy(self) -> bool:
        return http_ok(f"{self.url}/-/ready")


def start_allocator(
    args: Sequence[str] = (),
    *,
    listen: str = "127.0.0.1:0",
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> AllocatorProcess:
    """An allocator of its own on `listen` (port 0: a free one), serving when this returns."""
    server = AllocatorProcess(args, listen=listen, env=env)
    try:
        return server.start().wait_healthy(timeout)
    except BaseException:
        server.kill()
        raise


def start_redis(timeout: float = 15.0) -> RedisProcess:
    """A private redis-server on a free port, answering PING when this returns
    (FileNotFoundError when it is not installed)."""
    redis = RedisProcess()
    try:
        return redis.start().wait_healthy(timeout)
    except BaseException:
        redis.stop()
        raise


# How a supervised stack restarts a process that exits (`supervise`).
RESTART_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0)
FAST_EXIT_S = 30.0
GIVE_UP_AFTER = 5  # exits in a row that fast: the process is given up on


def supervise(
    services: Mapping[str, Service],
    stopping: threading.Event,
    lock: threading.Lock,
    say: Callable[[str], None],
) -> None:
    """Restart each of `services` that exits until `stopping` is set, one line
    each through `say` (`LocalStack.supervise` says how); StackError when one
    keeps exiting fast."""
    in_a_row: dict[str, int] = {}  # exits within FAST_EXIT_S of their start, in a row
    due: dict[str, float] = {}  # name -> when it is restarted
    while not stopping.is_set():
        now = time.monotonic()
        for name, service in list(services.items()):
            proc = service.proc
            if proc is None or proc.alive():
                continue
            if name not in due:
                fast = now - service.started_at < FAST_EXIT_S
                n = in_a_row[name] = in_a_row.get(name, 0) + 1 if fast else 0
                if n >= GIVE_UP_AFTER:
                    raise StackError(
                        proc.describe_failure(
                            f"exited ({proc.exit_status()}) {n} times in a row within "
                            f"{FAST_EXIT_S:g} s of starting; given up on"
                        )
                    )
                delay = RESTART_DELAYS[min(max(n - 1, 0), len(RESTART_DELAYS) - 1)]
                due[name] = now + delay
                say(
                    f"{name} exited ({proc.exit_status()}); restarting it in {delay:g} s "
                    f"(restart {service.starts}" + (f", {n} fast exits in a row" if n else "") + ")"
                )
            elif now >= due[name]:
                with lock:
                    if stopping.is_set():
                        return
                    proc.finish()
                    service.start()
                del due[name]
        stopping.wait(0.1)
