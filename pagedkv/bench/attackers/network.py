"""Attacks over a socket: a server that answers as a worker (`Attacker`, `rogue_pool`), and
connections that send nothing, or a head or body that never ends."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import PoolConfig
from pagedkv_base.api.serving import raise_open_files_limit

PWNED = "pwned"  # the text the attacker answers every completion with


class Attacker:
    """An HTTP server that answers completions with its own text and records
    every request and Authorization header it is sent. Its identity route
    relays what the real worker at `relay` answers (a real proof, for the
    real worker's pool), or, without `relay`, a forged proof for `pool_id`."""

    def __init__(self, model: str, relay: str | None = None) -> None:
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, authorization)
        self.relay, self.pool_id = relay, ""
        attacker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                attacker.requests.append(("GET", self.path, self.headers.get("authorization")))
                if self.path.startswith("/pagedkv/identity"):
                    if attacker.relay:
                        r = httpx.get(attacker.relay + self.path, timeout=5)
                        return self._answer(r.status_code, r.json())
                    return self._answer(
                        200, {"pool_id": attacker.pool_id, "worker_id": "evil", "proof": "0" * 64}
                    )
                if self.path.startswith("/health"):
                    return self._answer(200, {"status": "ok"})
                self._answer(200, {"object": "list", "data": [{"id": model, "object": "model"}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                attacker.requests.append(("POST", self.path, self.headers.get("authorization")))
                self._answer(
                    200,
                    {
                        "id": "cmpl-evil",
                        "object": "text_completion",
                        "created": 0,
                        "model": model,
                        "choices": [
                            {"index": 0, "text": PWNED, "finish_reason": "stop", "logprobs": None}
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    },
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Attacker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def posts(self) -> int:
        return sum(m == "POST" for m, _, _ in self.requests)

    @property
    def credentials_seen(self) -> int:
        """Requests that carried an Authorization header (a user's key, or the router's)."""
        return sum(auth is not None for _, _, auth in self.requests)


def rogue_pool(
    address: str, worker_id: str, url: str, model: str, token: str | None
) -> GrpcAllocator:
    """A pool registered as `worker_id`, advertising `url` under
    `model` (raises grpc.RpcError if refused)."""
    spec = PoolSpec(
        worker_id,
        PoolConfig(4096, 16, True, "attacker"),
        advertise_url=url,
        served_model_name=model,
    )
    return GrpcAllocator(address, spec, auth_token=token, retries=0, register_wait_s=0)


SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"  # never ends its head


# never ends its body
SLOW_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 1000\r\n\r\n{"
)


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to an http://HOST:PORT[/...] address."""
    host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


FILES_BESIDE = 256  # descriptors this process keeps for everything but the idle connections


class TooFewFiles(OSError):
    """This process may not open that many connections (its open-file limit)."""


def idle_connections(url: str, n: int, timeout: float = 10.0) -> list[socket.socket]:
    """`n` connections to `url` that send nothing, this process's open-file
    limit raised to hold them first (`TooFewFiles` if its hard limit is too low)."""
    limit = raise_open_files_limit()
    if limit < n + FILES_BESIDE:
        raise TooFewFiles(
            f"{n} idle connections need an open-file limit of {n + FILES_BESIDE}; "
            f"this process's is {limit} (ulimit -n)"
        )
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(connect(url, timeout))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def read_to_close(sock: socket.socket) -> None:
    """Returns once the other end closes (socket.timeout if it
    does not within the socket's timeout)."""
    while sock.recv(65536):
        pass


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed (or reset) the connection; never waits."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def slow_clients(
    url: str, heads: int, bodies: int
) -> tuple[list[socket.socket], list[socket.socket]]:
    """`heads` connections that send part of a request's head and `bodies`
    that send a head and part of its body, then nothing more."""
    h = [connect(url) for _ in range(heads)]
    for sock in h:
        sock.sendall(SLOW_HEAD)
    b = [connect(url) for _ in range(bodies)]
    for sock in b:
        sock.sendall(SLOW_BODY)
    return h, b


def big_text(nbytes: int) -> str:
    """About `nbytes` of plain words."""
    return "hello paged world, " * (nbytes // 19)
