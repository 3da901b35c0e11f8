"""Assembling and running the gRPC server.

`create_server(address, service) -> (server, port)` builds a server (not yet
started) with the Allocator service, the standard health service and server
reflection; binding port 0 picks a free port. `serve(...)` is the process:
state, metrics endpoint, lease reaper, SIGTERM.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from allocator_service.config import ServiceConfig
from allocator_service.roles import Roles, WorkerGrant
from allocator_service.rpc.interceptors import (
    MetricsInterceptor,
    RoleInterceptor,
    StandbyInterceptor,
)
from allocator_service.rpc.servicer import SERVICE_NAME, allocator_handler
from allocator_service.service import AllocatorService

log = logging.getLogger("allocator_service")

# The interpreter's thread switch interval in the server process: how long
# one thread's Python code keeps the interpreter while another waits for it.
# Python's 5 ms while every call in flight is short: a fleet's Steps, each a
# millisecond or two, then run to their end one after another instead of in
# 0.5 ms turns, where each took as long as all of them together
# (docs/performance.md, "Threads taking turns"). 0.5 ms while a call runs
# past its fair-share slice (a 32k-token admit: `FairShare.slice_s`) or a
# call that may be long is in flight (a slow read, a router's call), so that
# it keeps another pool's request from running for 0.5 ms at a stretch
# (docs/reliability.md, "Isolation and bounded cost").
GIL_SWITCH_S = 0.005
LONG_CALL_SWITCH_S = 0.0005
# The garbage collector's thresholds in the server process. A Step's own
# objects (its decoded request, lists of ids, its answer) die within the
# Step while the pools' state lives on: the young generation is collected
# every 50,000 container allocations instead of Python's 700, which ran a
# collection several times a Step and a full one, tens of milliseconds
# long, every few seconds under a fleet (docs/performance.md).
GC_THRESHOLDS = (50_000, 20, 10)


def create_server(
    address: str,
    service: AllocatorService | None = None,
    *,
    auth_token: str | None = None,
    admin_token: str | None = None,
    router_token: str | None = None,
    worker_tokens: Mapping[str, WorkerGrant] | None = None,
    tls: tuple[bytes, bytes] | None = None,
    rpc_histogram=None,
    health_servicer: health.HealthServicer | None = None,
    max_workers: int = 16,
) -> tuple[grpc.Server, int]:
    """A server for `service` bound to `address` (HOST:PORT; port 0 = any).

    `tls` is (certificate chain PEM, private key PEM); `auth_token` (pools),
    `admin_token`, `router_token` and `worker_tokens` (token -> the worker
    it may register) turn on the bearer-token roles (`roles.py`);
    `rpc_histogram` (prometheus Histogram with labels
    method, code) turns on RPC latency metrics."""
    service = service if service is not None else AllocatorService()
    interceptors: list[grpc.ServerInterceptor] = []
    if rpc_histogram is not None:
        interceptors.append(MetricsInterceptor(rpc_histogram))  # outermost: sees rejections too
    roles = Roles(
        auth_token or None, admin_token or None, router_token or None, worker_tokens or {}
    )
    # a standby answers with the leader's address, before anything else is looked at
    leadership = service.leadership
    interceptors.append(
        StandbyInterceptor(lambda: (leadership.durable.leading, leadership.leader_address))
    )
    if roles.any_token:  # with none, every caller is a pool and router calls are open
        interceptors.append(RoleInterceptor(roles))
    limits = service.limits
    size = limits.max_message_bytes
    server = grpc.server(
        # Each open StepStream and WatchEvents stream holds a thread for its
        # life, and each slow read (`servicer.SLOTTED`) for its length, each
        # bounded in number: room for all of them beside `max_workers` threads
        # that only short calls (heartbeats, Steps, registrations) can hold.
        futures.ThreadPoolExecutor(
            max_workers=max_workers
            + limits.max_step_streams
            + limits.max_watchers
            + limits.max_router_watchers
            + limits.max_slow_calls,
            thread_name_prefix="rpc",
        ),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            # A second server on the same port must fail, not share it.
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers((allocator_handler(service),))
    health_servicer = health_servicer or health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    watch_health(service, health_servicer)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if tls is not None:
        creds = grpc.ssl_server_credentials([(tls[1], tls[0])])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if not port:
        raise OSError(f"cannot listen on {address}")
    return server, port


def watch_health(service: AllocatorService, health_servicer: health.HealthServicer) -> None:
    """The gRPC health status follows the service's: NOT_SERVING while its
    state store is unreachable or lost (`AllocatorService.healthy`). The
    server's ("") says the process is sound (a standby that follows its
    leader is); the Allocator service's (`SERVICE_NAME`) says it serves
    calls: the leader only (a readiness probe)."""
    durable = service.leadership.durable
    serving_status, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )

    def follow(serving: bool, reason: str) -> None:
        health_servicer.set("", serving_status if serving else not_serving)
        health_servicer.set(
            SERVICE_NAME, serving_status if serving and durable.leading else not_serving
        )

    service.add_health_listener(follow)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    listen: str = "127.0.0.1:50051"
    state: str = "memory"
    metrics_port: int | None = None
    playground: bool = False  # /playground on the metrics port
    auth_token: str | None = None
    admin_token: str | None = None
    router_token: str | None = None
    worker_tokens: Mapping[str, WorkerGrant] = field(default_factory=dict)
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    config: ServiceConfig = ServiceConfig()
    grace_s: float = 5.0
    # Redis WAIT after every journal write: this many replicas, this long.
    redis_wait_replicas: int = 0
    redis_wait_timeout_s: float = 1.0
    # The leader lease (store/leader.py): its length, and the address the
    # leader names for clients a standby sends on (None: HOST:PORT of `listen`).
    leader_lease_s: float = 1.0
    advertise_address: str | None = None


def resolve_port(listen: str) -> str:
    """`listen` with port 0 replaced by a free port (the OS's pick)."""
    host, _, port = listen.rpartition(":")
    if port != "0":
        return listen
    import socket

    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host.strip("[]") or "", 0))
        return f"{host}:{s.getsockname()[1]}"


def advertised(listen: str) -> str:
    """The address clients reach `listen` at: the host's name for every interface."""
    host, _, port = listen.rpartition(":")
    if host in ("", "0.0.0.0", "[::]"):
        import socket

        host = socket.gethostname()
    return f"{host}:{port}"


def serve(opts: ServeOptions) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status."""
    from allocator_service.rpc.metrics import make_registry
    from allocator_service.store.journal import open_journal
    from allocator_service.web.app import start_web_server, stop_web_server

    # the leader lease names the port: known before the state is claimed
    listen = resolve_port(opts.listen)
    host = listen.rsplit(":", 1)[0]
    journal = open_journal(
        opts.state,
        wait_replicas=opts.redis_wait_replicas,
        wait_timeout_s=opts.redis_wait_timeout_s,
        address=opts.advertise_address or advertised(listen),
        lease_s=opts.leader_lease_s,
    )
    sys.setswitchinterval(GIL_SWITCH_S)
    gc.set_threshold(*GC_THRESHOLDS)
    service = AllocatorService(opts.config, journal)
    # One pool's long Python work must not keep another pool's Step waiting
    # for the interpreter: hand it over every LONG_CALL_SWITCH_S meanwhile.
    service.fair.on_long_calls = lambda some: sys.setswitchinterval(
        LONG_CALL_SWITCH_S if some else GIL_SWITCH_S
    )
    registry, histogram = make_registry(service)
    health_servicer = health.HealthServicer()
    tls = (opts.tls_cert, opts.tls_key) if opts.tls_cert and opts.tls_key else None
    server, port = create_server(
        listen,
        service,
        auth_token=opts.auth_token,
        admin_token=opts.admin_token,
        router_token=opts.router_token,
        worker_tokens=opts.worker_tokens,
        tls=tls,
        rpc_histogram=histogram,
        health_servicer=health_servicer,
    )
    if not opts.auth_token and not opts.worker_tokens:
        log.warning(
            "no worker credentials (--worker-tokens-file, --auth-token-file): any caller may "
            "register a pool; use this only where nobody else reaches the allocator"
        )
    if opts.auth_token and not opts.router_token:
        log.warning(
            "no router token (--router-token-file): MatchPrefix, "
            "WatchEvents and ListPools answer the admin token only"
        )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    service.start()
    gc.freeze()  # the state restored from the journal is long-lived: no collection walks it
    server.start()
    httpd = None
    if opts.metrics_port is not None:
        metrics_host = host.strip("[]") if host not in ("", "[::]", "0.0.0.0") else "0.0.0.0"
        # /metrics, the live /pools page and, if asked for, /playground (allocator_service/web/)
        httpd = start_web_server(
            opts.metrics_port,
            metrics_host,
            registry=registry,
            service=service,
            roles=Roles(
                opts.auth_token or None,
                opts.admin_token or None,
                opts.router_token or None,
                opts.worker_tokens,
            ),
            playground=opts.playground,
        )
        print(
            f"pagedkv allocator: metrics on http://{metrics_host}:{httpd.server_port}/metrics",
            file=sys.stderr,
            flush=True,
        )
    # Tests and operators read this line; keep its shape.
    print(
        f"pagedkv allocator: listening on {host}:{port} ({'TLS' if tls else 'plaintext'}, "
        f"state {journal.describe()}, {len(service.registry.pools)} pools restored)"
        + (
            ""
            if service.leadership.durable.leading
            else f" as a standby of {service.leadership.leader_address}"
        ),
        file=sys.stderr,
        flush=True,
    )
    while not stop.wait(1.0):
        pass
    log.info("shutting down")
    health_servicer.enter_graceful_shutdown()
    service.events.close()  # end WatchEvents streams now rather than at the end of the grace
    stopped = server.stop(opts.grace_s)  # no new calls from here
    # idle StepStreams too: their workers retry at the next server
    service.streams.end_step_streams()
    stopped.wait()
    service.close()
    if httpd is not None:
        stop_web_server(httpd)
    return 0
