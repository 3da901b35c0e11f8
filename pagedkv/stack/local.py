"""`LocalStack`: the docker-compose topology as local processes.

One allocator (gRPC, in-memory state unless told otherwise), N workers serving
the OpenAI-style HTTP API, optionally the router in front of them
(`router=True`: the one address clients use), and optionally a Redis for the allocator's journal
(`redis=True`) and a Prometheus scraping everything (`prometheus=True`) when
their binaries are on PATH::

    from pagedkv.stack import LocalStack

    with LocalStack(workers=2, model="tiny-random", worker_args=["--num-blocks", "128"]) as stack:
        stack.worker_urls            # ["http://127.0.0.1:PORT", ...]: /v1/..., /health, /metrics
        stack.router_url             # "http://127.0.0.1:PORT" with router=True, else None
        stack.allocator_address      # "127.0.0.1:PORT" (gRPC)
        stack.allocator_metrics_url  # "http://127.0.0.1:PORT/metrics"
        stack.prometheus_url         # "http://127.0.0.1:PORT", or None (not asked for / no binary)
        stack.redis_url              # "redis://127.0.0.1:PORT/0", or None
        stack.logs("worker-1")       # that process's last output lines
        stack.allocator.kill(); stack.allocator.start().wait_healthy()
        # a crash and a restart in place

- Every port defaults to a free one (0); `pagedkv up` defaults to fixed ports
  (router 8000; workers 8001, 8002, ...; allocator 50051) like docker-compose.
  Every worker advertises its URL with its pool, so the router (started
  last, once the workers are healthy) finds them through the allocator.
- `__enter__` returns once every process is healthy (gRPC health for the
  allocator, GET /health for workers, /-/ready for Prometheus, PING for Redis)
  or raises `StackError` naming the process that failed, with its last lines;
  nothing is left running then, and a temporary log folder is kept for a
  look (`stack.log_dir`). `__exit__` stops everything (workers and Prometheus,
  then the allocator, then Redis: SIGTERM, SIGKILL after `grace` seconds);
  `logs()` works until then.
- Workers divide the cores: each gets `--threads 1/N` (N workers), so
  max(1, cores // N) threads, unless `worker_args` or PAGEDKV_WORKER_THREADS
  say otherwise.
- `env`: variables given to every process on top of this one's environment
  (which they inherit): the settings that are variables only, such as
  `PAGEDKV_ALLOCATOR_LEASE_TTL`, or any other (`PAGEDKV_WORKER_BLOCK_SIZE`).
- `redis=True` / `prometheus=True` without the binary: a warning, and the
  stack runs without it (`redis_url` / `prometheus_url` are None).
- `router=True`: the router (`python -m router`) in front of the workers, on
  `router_port`, with `router_args`; `worker_host="127.0.0.1"` keeps the
  workers on loopback while the router (and the allocator) bind `host`.
- `standby=True` (needs Redis state): each allocator gets a hot standby
  ("allocator-standby", ...: the same state, the ports after every
  allocator's when fixed; `standbys`, `standby_addresses`), started once
  its leader serves; both run `--standby`, so either one, restarted,
  follows whichever leads then; each worker is given `LEADER,STANDBY` and the
  router `LEADER|STANDBY` per allocator, and they follow whichever leads.
- `kv_roles=[ROLE, ...]`: a prefill/decode fleet, one worker per role
  (`--kv-role prefill|decode|both`; `workers` is then their number), and an
  allocator shared store their blocks move through: `file://<log dir>/kv-store`
  of `shared_store_gib` GiB, unless `allocator_args` name one.
- `allocators=N`: pools sharded over N allocator processes ("allocator",
  "allocator-2", ...; ports `allocator_port + i` and `allocator_metrics_port
  + i` when fixed); worker i registers with allocator ((i - 1) mod N), the
  router follows them all (`--allocator A,B,...`). With Redis state each
  keeps its journal under a key prefix of its own (the first the state
  URL's `key_prefix`, default `pagedkv:allocator:`; allocator i that prefix
  plus `shard-i:`). Their `--state`, `--listen` and `--metrics-port` are
  the stack's to set: `allocator_args` may not give them then. `allocator` / `allocator_address` are
  the first one's; `allocator_addresses` lists all.
- Credentials (`credentials=True`, the default: a token per worker, bound to
  its id and address, one store group, router and admin tokens), `token=T`
  (one shared worker token), `api_key=True` (the clients' key, which the
  router and every worker require), `guest_workers=[(ID, URL), ...]`
  (workers the stack does not run, each given a token and a store group of
  its own): written to the log folder, readable by this user only
  (`credentials.stack_wiring`). Neither credentials nor a token: any caller
  may register a pool (a development setup).
- `tls=(cert, key)`: the allocator serves TLS with that certificate (which
  must name localhost), and the workers are given what they need to call it.
- The processes die with the thread that started the stack (see
  `pagedkv.stack.process`): start it from one that outlives it.
- `supervise()` restarts every process that exits, as compose's
  `restart: unless-stopped` does (its docstring says how).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from pagedkv.stack.credentials import ADMIN_TOKEN, API_KEYS, ROUTER_TOKEN, stack_wiring
from pagedkv.stack.probes import free_port, port_in_use
from pagedkv.stack.process import Process, StackError, stop_processes, wait_healthy
from pagedkv.stack.services import (
    AllocatorProcess,
    PrometheusProcess,
    RedisProcess,
    RouterProcess,
    Service,
    WorkerProcess,
    prometheus_config,
    supervise,
)
from pagedkv_base.settings import env_name, thread_share

THREADS_ENV = env_name("worker", "--threads")
# Seconds before restarting a process that exited: the first, its second, ... exit in a row within
# FAST_EXIT_S of its start (an exit after a longer run: the first's).
_COLOURS = (
    "cyan",
    "magenta",
    "green",
    "yellow",
    "blue",
    "bright_red",
    "bright_cyan",
    "bright_magenta",
)


class LocalStack:
    """Allocator + N workers (+ Redis, + Prometheus) as local
    processes; see the module docstring."""

    def __init__(
        self,
        workers: int = 2,
        model: str = "smollm2",
        *,
        allocators: int = 1,
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
        token: str | None = None,
        credentials: bool = True,
        api_key: bool = False,
        tls: tuple[Path, Path] | None = None,
        router: bool = False,
        router_port: int = 0,
        router_args: Sequence[str] = (),
        worker_host: str | None = None,
        env: Mapping[str, str] | None = None,
        guest_workers: Sequence[tuple[str, str]] = (),
        standby: bool = False,
        kv_roles: Sequence[str] = (),
        shared_store_gib: float = 4.0,
    ) -> None:
        self.kv_roles = list(kv_roles)
        self.shared_store_gib = shared_store_gib
        workers = len(self.kv_roles) or workers
        if self.kv_roles and allocators > 1:
            raise StackError(
                "a prefill/decode fleet moves its blocks through one allocator's shared store: "
                "--allocators must be 1"
            )
        if workers < 1:
            raise StackError("--workers must be at least 1")
        if not 1 <= allocators <= workers:
            raise StackError(
                "--allocators must be at least 1 and at most "
                "--workers (each holds some workers' pools)"
            )
        self.num_allocators = allocators
        if allocators > 1 and {"--state", "--listen", "--metrics-port"} & {
            a.split("=")[0] for a in allocator_args
        }:
            raise StackError(
                "with --allocators > 1 each allocator gets its own --state key prefix, --listen "
                "and --metrics-port: give the state with --state, the ports with "
                "PAGEDKV_UP_ALLOCATOR_PORT and PAGEDKV_UP_ALLOCATOR_METRICS_PORT"
            )
        if redis and state != "memory":
            raise StackError(
                f"--redis starts its own Redis; it cannot be combined with --state {state}"
            )
        if standby and not redis and state == "memory":
            raise StackError(
                "--standby follows the allocator's journal: give --redis or --state redis://..."
            )
        self.want_standby = standby
        self.num_workers = workers
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
        self.token = token
        self.credentials = credentials
        self.want_api_key = api_key
        if guest_workers and (token is not None or not credentials):
            raise StackError(
                "guest workers get generated credentials: give them without a token and with "
                "credentials on"
            )
        self.guest_workers = list(guest_workers)
        self.tls = tls
        self.want_router = router
        self.router_port = router_port
        self.router_args = list(router_args)
        # where workers bind (default `host`): loopback keeps them internal behind the router
        self.worker_host = worker_host or host
        self.env = dict(env or {})
        self._own_log_dir = log_dir is None
        self.failed = False  # a failed stack keeps even a temporary log folder
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.echo = echo
        self.console = None
        self.services: dict[str, Service] = {}  # by name, in start order
        self.redis: RedisProcess | None = None
        self.allocator: AllocatorProcess | None = None  # the first of `allocators`
        self.allocators: list[AllocatorProcess] = []
        # with `standby`: allocator i's hot standby
        # ("allocator-standby", "allocator-2-standby", ...)
        self.standbys: list[AllocatorProcess] = []
        self.standby_addresses: list[str] = []
        self.standby_metrics_urls: list[str] = []
        self.workers: list[WorkerProcess] = []
        self.prometheus: PrometheusProcess | None = None
        self.router: RouterProcess | None = None
        self.router_url: str | None = None
        self.hurry = threading.Event()  # set it to skip the grace period of a running stop()
        self.worker_urls: list[str] = []
        self.allocator_address: str | None = None
        self.allocator_metrics_url: str | None = None
        self.allocator_addresses: list[str] = []
        self.allocator_metrics_urls: list[str] = []
        self.prometheus_url: str | None = None
        self.redis_url: str | None = None
        self.warnings: list[str] = []
        self.restarts: list[str] = []  # one line per restart `supervise` made
        self._ports: dict[int, str] = {}  # fixed ports given out by this start, by whom
        self._stopping = threading.Event()  # set by stop(): `supervise` restarts nothing more
        self._lock = threading.Lock()  # a restart and stop() one at a time

    # -------------------------------------------------------------- lifecycle

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalStack:
        from rich.console import Console

        self.console = Console(highlight=False) if self.echo else None
        self._stopping.clear()
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

    @property
    def processes(self) -> dict[str, Process]:
        """The current process of each service, by name ("allocator", "worker-1", ...)."""
        return {name: s.proc for name, s in self.services.items() if s.proc is not None}

    def _port(self, port: int, name: str) -> int:
        if port == 0:
            return free_port(self.connect_host)
        if port in self._ports:  # e.g. allocator port P with --allocators 2 and metrics on P + 1
            raise StackError(f"port {port} for {name} is also the port of {self._ports[port]}")
        if port_in_use(self.connect_host, port):
            raise StackError(
                f"port {port} for {name} is already in use (pass 0 to pick a free port)"
            )
        self._ports[port] = name
        return port

    def _add(self, cls, *args, **kw):
        """Make a service of this stack (its log file, colour, console; dies with the launcher)."""
        name = kw.get("name") or args[0]
        env = {**self.env, **(kw.pop("env", None) or {})}  # the stack's, then this service's own
        service = cls(
            *args,
            log_path=self.log_dir / f"{name}.log",
            console=self.console,
            colour=_COLOURS[len(self.services) % len(_COLOURS)],
            die_with_parent=True,
            env=env,
            **kw,
        )
        self.services[service.name] = service
        return service

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        if self.console is not None:
            self.console.print(f"[yellow]warning:[/] {message}", highlight=False)

    def _start(self) -> None:
        self._ports = {}
        h = self.connect_host
        state = self.state
        if self.want_redis:
            if shutil.which("redis-server") is None:
                self._warn(
                    "--redis: no redis-server on PATH; the allocator keeps its state in memory"
                )
            else:
                self.redis = self._add(
                    RedisProcess, name="redis", host=h, data_dir=self.log_dir / "redis"
                )
                self.redis.start().wait_healthy(self.startup_timeout)
                self.redis_url = state = self.redis.url
        if self.want_standby and state == "memory":
            raise StackError("--standby: no redis-server on PATH for the journal it follows")

        # The workers are made (not started) first: their addresses go into their credentials.
        share = (
            []
            if THREADS_ENV in {**os.environ, **self.env}
            else ["--threads", thread_share(self.num_workers)]
        )
        for i in range(1, self.num_workers + 1):
            name = f"worker-{i}"
            port = self._port(self.base_port + i - 1 if self.base_port else 0, name)
            self.workers.append(
                self._add(
                    WorkerProcess,
                    name,
                    model=self.model,
                    allocator="",
                    args=[*share, *self.worker_args, *_role_args(self.kv_roles, i - 1)],
                    host=self.worker_host,
                    port=port,
                    connect_host=h,
                )
            )
            self.worker_urls.append(self.workers[-1].url)

        allocator_args: list[str] = []
        if self.kv_roles and "--kv-shared-store" not in self.allocator_args:
            store = (self.log_dir / "kv-store").resolve()
            allocator_args += ["--kv-shared-store", f"file://{store}"]
            allocator_args += ["--kv-shared-store-size", f"{self.shared_store_gib:g}"]
        wiring = stack_wiring(
            self.log_dir,
            [(w.worker_id, w.url) for w in self.workers],
            token=self.token,
            credentials=self.credentials,
            guest_workers=self.guest_workers,
            api_key=self.want_api_key,
            tls=self.tls,
        )
        allocator_args += wiring.allocator
        allocator_env = wiring.allocator_env
        for worker in self.workers:
            worker.args += [*wiring.per_worker.get(worker.worker_id, ()), *wiring.api_keys]
        connect = "localhost" if self.tls is not None else h  # the certificate names localhost

        def allocator_process(name: str, n: int, shard: int, standby: bool):
            """Allocator process `name` (the n-th on the fixed ports); its address, its
            metrics URL."""
            aport = self._port(self.allocator_port + n if self.allocator_port else 0, f"the {name}")
            mport = self._port(
                self.allocator_metrics_port + n if self.allocator_metrics_port else 0,
                f"the {name}'s metrics",
            )
            args = ["--metrics-port", str(mport), "--state", _shard_state(state, shard)]
            process = self._add(
                AllocatorProcess,
                [*args, *(["--standby"] if standby else []), *allocator_args, *self.allocator_args],
                name=name,
                listen=f"{self.host}:{aport}",
                connect_host=connect,
                probe_grpc=self.tls is None,
                env=allocator_env,
            )
            return process, f"{connect}:{aport}", f"http://{h}:{mport}/metrics"

        for i in range(self.num_allocators):
            # with a standby both run --standby: the first to start leads, and either,
            # restarted, follows whichever leads then
            name = "allocator" if i == 0 else f"allocator-{i + 1}"
            process, address, metrics = allocator_process(name, i, i, self.want_standby)
            self.allocators.append(process)
            self.allocator_addresses.append(address)
            self.allocator_metrics_urls.append(metrics)
        self.allocator = self.allocators[0]
        self.allocator_address = self.allocator_addresses[0]
        self.allocator_metrics_url = self.allocator_metrics_urls[0]
        wait_healthy([(a.start().proc, a.healthy) for a in self.allocators], self.startup_timeout)
        # Each allocator's standby: the same state, started once its leader holds the lease.
        groups = [[a] for a in self.allocator_addresses]
        for i in range(self.num_allocators if self.want_standby else 0):
            name = f"{self.allocators[i].name}-standby"
            process, address, metrics = allocator_process(name, self.num_allocators + i, i, True)
            self.standbys.append(process)
            self.standby_addresses.append(address)
            self.standby_metrics_urls.append(metrics)
            groups[i].append(address)
        wait_healthy([(a.start().proc, a.healthy) for a in self.standbys], self.startup_timeout)

        # The workers share this machine: each takes 1/N of the cores unless told
        # otherwise (a --threads in worker_args comes later and wins; so does the
        # environment's PAGEDKV_WORKER_THREADS). Each would take every core.
        checks = []
        for i, worker in enumerate(self.workers):
            # a leader and its standby: it follows
            worker.allocator = ",".join(groups[i % self.num_allocators])
            worker.args += wiring.to_allocator
            checks.append((worker.start().proc, worker.healthy))

        if self.want_router:
            rport = self._port(self.router_port, "the router")
            # each allocator once; one with a standby as LEADER|STANDBY
            self.router = self._add(
                RouterProcess,
                name="router",
                allocator=",".join("|".join(g) for g in groups),
                model=self.model,
                args=[*wiring.router_to_allocator, *wiring.api_keys, *self.router_args],
                host=self.host,
                port=rport,
                connect_host=h,
            )
            self.router_url = self.router.url
            # after the workers: its /health waits for one it can reach
            wait_healthy(checks, self.startup_timeout)
            checks = [(self.router.start().proc, self.router.healthy)]

        if self.want_prometheus:
            prom_bin = shutil.which("prometheus")
            if prom_bin is None:
                self._warn("--prometheus: no prometheus binary on PATH; running without it")
            else:
                pport = self._port(self.prometheus_port, "Prometheus")
                config = self.log_dir / "prometheus.yml"
                config.write_text(
                    prometheus_config(
                        [
                            u.removeprefix("http://").removesuffix("/metrics")
                            for u in self.allocator_metrics_urls + self.standby_metrics_urls
                        ],
                        [u.removeprefix("http://") for u in self.worker_urls],
                        self.scrape_interval,
                        [self.router_url.removeprefix("http://")] if self.router_url else (),
                    )
                )
                self.prometheus = self._add(
                    PrometheusProcess,
                    prom_bin,
                    config,
                    self.log_dir / "prometheus-data",
                    name="prometheus",
                    host=h,
                    port=pport,
                )
                self.prometheus_url = self.prometheus.url
                checks.append((self.prometheus.start().proc, self.prometheus.healthy))
        wait_healthy(checks, self.startup_timeout)

    def supervise(self) -> None:
        """Restart each process that exits, until `stop()` (what `pagedkv up` runs
        once the stack is healthy): on the same address with the same arguments
        and log, after a delay that doubles with each exit in a row within
        `FAST_EXIT_S` of its start (`RESTART_DELAYS`), one line per restart
        (also kept in `restarts`). A process that exits `GIVE_UP_AFTER` times in
        a row that fast is given up on: StackError, with its last lines. An
        allocator with `--state memory` comes back empty: each worker registers
        a new pool with it, recomputes what it was computing, and the router
        proves the new pools before it routes to them; with Redis state it
        comes back with every pool. Run it from the thread that started the
        stack: restarted processes die with the thread that starts them."""
        supervise(self.services, self._stopping, self._lock, self._say)

    def _say(self, line: str) -> None:
        self.restarts.append(line)
        if self.console is not None:
            self.console.print(f"[yellow]pagedkv up:[/] {line}", highlight=False)

    def stop(self) -> None:
        """Stop every process (the router, then workers and Prometheus,
        then the allocator, then Redis). Idempotent."""
        with self._lock:
            self._stopping.set()
        p = self.processes
        tiers = [
            [p[k] for k in ("router",) if k in p],
            [v for k, v in p.items() if k.startswith("worker-") or k == "prometheus"],
            [v for k, v in p.items() if k == "allocator" or k.startswith("allocator-")],
            [p[k] for k in ("redis",) if k in p],
        ]
        try:
            stop_processes(tiers, self.grace, self.hurry)
        finally:
            self.services = {}
            if self._own_log_dir and self.log_dir is not None and not self.failed:
                shutil.rmtree(self.log_dir, ignore_errors=True)
                self.log_dir = None

    # -------------------------------------------------------------- inspection

    def logs(self, name: str) -> list[str]:
        """The last output lines of process `name` ("allocator",
        "worker-1", "redis", "prometheus")."""
        return list(self.processes[name].tail)

    def wait(self) -> Process:
        """Block until some process exits, and return it (a healthy stack never returns)."""
        while True:
            for proc in self.processes.values():
                if not proc.alive():
                    return proc
            time.sleep(0.2)

    @property
    def router_credentials(self) -> list[str]:
        """What another router of this stack needs to follow its allocators."""
        path = self.log_dir / ROUTER_TOKEN if self.log_dir is not None else None
        return ["--router-token-file", str(path)] if path is not None and path.exists() else []

    @property
    def router_token(self) -> str | None:
        """The router's token for the allocator (None: the stack has none)."""
        return self._read_secret(ROUTER_TOKEN)

    @property
    def api_key(self) -> str | None:
        """The key the stack's clients send (None: its API is open)."""
        return self._read_secret(API_KEYS) if self.want_api_key else None

    @property
    def admin_token(self) -> str | None:
        """The allocator's admin token (None: the stack has none)."""
        return self._read_secret(ADMIN_TOKEN)

    def _read_secret(self, name: str) -> str | None:
        path = self.log_dir / name if self.log_dir is not None else None
        return path.read_text().strip() if path is not None and path.exists() else None

    def describe(self) -> dict:
        return {
            "allocator": self.allocator_address,
            "allocator_metrics": self.allocator_metrics_url,
            "allocators": list(self.allocator_addresses),
            "standbys": list(self.standby_addresses),
            "workers": list(self.worker_urls),
            "router": self.router_url,
            "prometheus": self.prometheus_url,
            "redis": self.redis_url,
            "pids": {name: proc.pid for name, proc in self.processes.items()},
            "log_dir": str(self.log_dir) if self.log_dir else None,
            "api_keys_file": str(self.log_dir / API_KEYS)
            if self.want_api_key and self.log_dir
            else None,
        }


def _role_args(roles: Sequence[str], index: int) -> list[str]:
    """Worker `index`'s (0-based) `--kv-role`, when the stack is given roles."""
    return ["--kv-role", roles[index]] if roles else []


def _shard_state(state: str, index: int) -> str:
    """The `--state` of allocator `index` (0-based): the first keeps the
    URL's key prefix, each other one that prefix plus `shard-<index + 1>:`,
    in the same Redis (the URL's rules are the journal's own)."""
    if index == 0 or not state.startswith(("redis://", "rediss://", "unix://")):
        return state
    from allocator_service.store.journal import with_prefix

    return with_prefix(state, f"shard-{index + 1}:")
