"""The allocator's HTTP port (/metrics, /pools) against clients that connect
and send nothing: they get no thread each (2,500 of them once pinned 2,500
threads and, closing together, stalled the allocator ~85 s), are closed
after the idle timeout, and gRPC answers throughout. `/playground` is off
unless the allocator is started with --playground."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from allocator_service.web.app import IDLE_TIMEOUT_S, MAX_CONNECTIONS
from pagedkv.bench.attackers import read_to_close


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_idle_connections_pin_no_threads_and_grpc_answers(allocator_server):
    with allocator_server("--metrics-port", "0") as server:
        host, port = server.metrics_url.removeprefix("http://").split("/")[0].rsplit(":", 1)
        assert _status(server.metrics_url) == 200
        before = _threads(server.pid)
        idle = [socket.create_connection((host, int(port)), timeout=3 * IDLE_TIMEOUT_S) for _ in range(300)]
        try:
            time.sleep(1.0)
            assert _threads(server.pid) <= before + MAX_CONNECTIONS  # not one per connection
            with grpc.insecure_channel(server.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                t0 = time.monotonic()
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
                assert status == health_pb2.HealthCheckResponse.SERVING and time.monotonic() - t0 < 5
            t0 = time.monotonic()
            for sock in idle:  # each closed by the server: at once over the bound, after the idle timeout within
                read_to_close(sock)
            assert time.monotonic() - t0 < 3 * IDLE_TIMEOUT_S
        finally:
            for sock in idle:
                sock.close()
        assert _status(server.metrics_url) == 200


def test_playground_is_off_on_the_allocator_port_unless_asked_for(allocator_server):
    with allocator_server("--metrics-port", "0") as plain:
        base = plain.metrics_url.rsplit("/", 1)[0]
        assert _status(f"{base}/playground") == 404
        run = urllib.request.Request(f"{base}/playground/api/run", data=b"{}", method="POST")
        assert _status(run) == 404
    with allocator_server("--metrics-port", "0", "--playground") as teaching:
        base = teaching.metrics_url.rsplit("/", 1)[0]
        assert _status(f"{base}/playground") == 200
        run = urllib.request.Request(f"{base}/playground/api/run", data=b"{}", method="POST",
                                     headers={"content-type": "application/json"})
        assert _status(run) == 200
