"""The allocator's HTTP port (/metrics, /pools) against clients that connect
and send nothing, or take nothing: with 1,000 of them open, /metrics and gRPC
still answer and no thread is spent on them; they are closed after the idle
timeout; one connection past the bound is answered 503 at once; `/pools`
streams past their bound are answered 503, and a stream whose client left
gives its place back. `/playground` is off unless the allocator is started
with --playground. (How long /metrics takes meanwhile is a figure of
`pagedkv bench attacks`, not asserted here.)"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from allocator_service.config import Limits
from allocator_service.web.app import IDLE_TIMEOUT_S
from pagedkv.bench.attackers import (
    FILES_BESIDE,
    TooFewFiles,
    connect,
    idle_connections,
    read_to_close,
)
from pagedkv_base.api.serving import raise_open_files_limit

IDLE = 1000


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.readline() if "stream" in url else r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _base(server) -> str:
    return server.metrics_url.rsplit("/", 1)[0]


@pytest.fixture
def enough_files():
    # the allocator inherits this limit; it keeps half of it for connections
    if raise_open_files_limit() < 2 * (IDLE + FILES_BESIDE):
        pytest.skip(
            f"needs an open-file limit (ulimit -n) of {2 * (IDLE + FILES_BESIDE)} for {IDLE} idle "
            f"connections; the hard limit here is lower"
        )


def test_a_thousand_idle_connections_cost_no_thread_and_metrics_and_grpc_answer(
    allocator_server, enough_files
):
    with allocator_server("--metrics-port", "0") as server:
        assert _get(server.metrics_url)[0] == 200
        before = _threads(server.pid)
        try:
            idle = idle_connections(server.metrics_url, IDLE, timeout=3 * IDLE_TIMEOUT_S)
        except TooFewFiles as exc:
            pytest.skip(str(exc))
        try:
            time.sleep(1.0)
            assert _threads(server.pid) <= before + 4  # a socket each, not a thread
            # answers at all: the figure is the bench's
            status, body = _get(server.metrics_url, timeout=10)
            assert status == 200 and b"pagedkv_allocator_pools" in body
            status, first = _get(_base(server) + "/pools/stream", timeout=10)
            assert status == 200 and first == b"retry: 2000\n"
            with grpc.insecure_channel(server.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            t0 = time.monotonic()
            for sock in idle:  # each closed by the server after the idle timeout
                read_to_close(sock)
            assert time.monotonic() - t0 < 3 * IDLE_TIMEOUT_S
        finally:
            for sock in idle:
                sock.close()
        assert _get(server.metrics_url)[0] == 200


def test_a_connection_past_the_bound_is_answered_503_at_once():
    from allocator_service.web.app import WebApp
    from pagedkv_base.api.serving import ServerThread, serve_options

    bound = 5
    app = WebApp(service=object())
    server = ServerThread(
        app,
        "127.0.0.1",
        0,
        **serve_options(header_timeout=30, body_timeout=30, max_connections=bound),
    ).start()
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        held = [connect(url) for _ in range(bound)]
        time.sleep(0.2)  # all accepted
        extra = connect(url, timeout=5)
        extra.settimeout(5)
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503 ") and answer.endswith(
            b"too many connections at once\n"
        )
        read_to_close(extra)  # and closed
        extra.close()
        held.pop().close()
        time.sleep(0.2)
        assert _get(url)[0] == 200  # a place came free
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_pools_streams_past_their_bound_are_answered_503_and_a_gone_client_frees_its_place(
    allocator_server,
):
    streams = Limits().max_watchers
    with allocator_server("--metrics-port", "0") as server:
        url = _base(server) + "/pools/stream"
        held = []
        try:
            for _ in range(streams):
                r = urllib.request.urlopen(url, timeout=10)
                assert r.status == 200 and r.readline() == b"retry: 2000\n"
                held.append(r)
            status, body = _get(url)
            assert status == 503 and b"event streams" in body
            held.pop().close()  # the page went away: its place is given back
            deadline = time.monotonic() + 10
            while (status := _get(url, timeout=10)[0]) == 503 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert status == 200
        finally:
            for r in held:
                r.close()


def test_a_client_that_takes_nothing_of_an_answer_is_cut_off():
    """The send deadline every port of ours may set (the allocator's: IDLE_TIMEOUT_S):
    an answer the client does not read, once it fills the buffers, ends the
    connection, and the app's next send returns, so a stream gives its place back."""
    from pagedkv_base.api.serving import ServerThread, serve_options

    ended = threading.Event()

    async def endless(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        chunk = b"x" * (1 << 20)
        for _ in range(4096):  # 4 GiB: far more than any socket buffers
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        ended.set()

    server = ServerThread(
        endless,
        "127.0.0.1",
        0,
        **serve_options(header_timeout=30, body_timeout=30, max_connections=8, send_timeout=1.0),
    ).start()
    try:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert ended.wait(30), "the app was still sending to a client that reads nothing"
        try:  # the rest, then the end (a timeout here: still open)
            while sock.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass  # the server dropped what it could not send
        sock.close()
    finally:
        server.stop()


def test_playground_is_off_on_the_allocator_port_unless_asked_for(allocator_server):
    with allocator_server("--metrics-port", "0") as plain:
        base = _base(plain)
        assert _get(f"{base}/playground")[0] == 404
        run = urllib.request.Request(f"{base}/playground/api/run", data=b"{}", method="POST")
        assert _status(run) == 404
    with allocator_server("--metrics-port", "0", "--playground") as teaching:
        base = _base(teaching)
        assert _get(f"{base}/playground")[0] == 200
        run = urllib.request.Request(
            f"{base}/playground/api/run",
            data=b"{}",
            method="POST",
            headers={"content-type": "application/json"},
        )
        assert _status(run) == 200


def _status(req) -> int:
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_flood_of_scrapes_holds_at_most_a_few_threads_and_every_one_is_answered():
    from concurrent.futures import ThreadPoolExecutor

    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily

    from allocator_service.web.app import WORK_THREADS, start_web_server, stop_web_server

    lock, inside, most = threading.Lock(), [0], [0]

    class Slow:  # a collector that takes a while, as one reading every pool under its lock does
        def collect(self):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.2)
            with lock:
                inside[0] -= 1
            yield GaugeMetricFamily("pagedkv_test_slow", "A slow gauge.", value=1)

    registry = CollectorRegistry()
    registry.register(Slow())
    most[0] = 0  # register() collected once
    server = start_web_server(0, "127.0.0.1", registry=registry, service=object())
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with ThreadPoolExecutor(4 * WORK_THREADS) as pool:
            answers = list(pool.map(lambda _: _get(url, timeout=30), range(4 * WORK_THREADS)))
        assert all(status == 200 and b"pagedkv_test_slow 1.0" in body for status, body in answers)
        assert 1 <= most[0] <= WORK_THREADS
    finally:
        stop_web_server(server)
