"""Start, probe and stop the processes of a PagedKV topology: the one launcher.

`pagedkv up`, the demo, the benchmarks and the tests all start Redis, the
allocator, workers and Prometheus through this package:

- `probes`: `free_port`, `port_in_use` and the health probes (`http_ok`,
  `grpc_health_ok`, `redis_ping_ok`).
- `process`: `Process` (one child: own session, output kept and echoed, dies
  with its launcher), `stop_processes` (SIGTERM, then SIGKILL, tier by tier),
  `wait_healthy`, `StackError`.
- `services`: `AllocatorProcess`, `RedisProcess`, `WorkerProcess`,
  `RouterProcess`, `PrometheusProcess`: start, health, kill -9, terminate and restart in place;
  `start_allocator` / `start_redis` for one of its own.
- `local`: `LocalStack`, the whole topology (what `pagedkv up` runs).

Heavy imports (grpc, rich) happen only when used, so a healthcheck
(`python -c "from pagedkv.stack import http_ok; ..."`) stays fast.
"""

from __future__ import annotations

from pagedkv.stack.local import LocalStack
from pagedkv.stack.probes import free_port, grpc_health_ok, http_ok, port_in_use, redis_ping_ok
from pagedkv.stack.process import Process, StackError, stop_processes, wait_healthy
from pagedkv.stack.services import (
    AllocatorProcess,
    PrometheusProcess,
    RedisProcess,
    RouterProcess,
    Service,
    WorkerProcess,
    prometheus_config,
    start_allocator,
    start_redis,
)

__all__ = [
    "AllocatorProcess",
    "LocalStack",
    "Process",
    "PrometheusProcess",
    "RedisProcess",
    "RouterProcess",
    "Service",
    "StackError",
    "WorkerProcess",
    "free_port",
    "grpc_health_ok",
    "http_ok",
    "port_in_use",
    "prometheus_config",
    "redis_ping_ok",
    "start_allocator",
    "start_redis",
    "stop_processes",
    "wait_healthy",
]
