"""Serving an app with uvicorn: the deadlines, bounds and start-up every
HTTP port of ours shares (the worker's, the router's, the allocator's).

Uvicorn times out only an idle kept-alive connection (`timeout_keep_alive`):
a client that opens a connection and sends its headers, or its body, a byte
at a time holds the connection, and its file descriptor, for as long as it
likes. `read_deadline_protocol` is uvicorn's own h11 protocol with two
deadlines: the request's headers must be in within `header_timeout` of the
connection opening (or of the previous answer on a kept-alive one), its
body within `body_timeout` after them; past either the connection is closed
(the app, if it was reading the body, sees the client gone). Once a request
is read whole nothing times out, unless `send_timeout` is given: then a
client that takes none of an answer for that long (the answer waiting in
the write buffer) is cut off. And it bounds connections where they are
accepted: one past `max_connections` is answered 503 and closed at once, so
idle clients hold at most that many file descriptors.

`serve_options` gives uvicorn that protocol, the same bound for requests in
progress (`limit_concurrency`), h11's bound on a request head
(`h11_max_incomplete_event_size`) and a keep-alive timeout. Every connection
is a file descriptor: it raises the process's open-file limit to its hard
limit (as Go's runtime does at start) and keeps `max_connections` to half of
it, so the rest of the process (gRPC, Redis, files) always has descriptors.

`serve` serves in the calling thread until SIGTERM or SIGINT (a process whose
only server this is); `ServerThread` serves on a thread and event loop of its
own, beside a process's other servers, installing no signal handlers.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

HEAD_BYTES = 64 << 10  # the largest request line and headers read
GRACE_S = 5.0  # at shutdown, answers in progress get this long to finish
_OVER_CAPACITY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 29\r\n"
    b"retry-after: 1\r\nconnection: close\r\n\r\ntoo many connections at once\n"
)


class _ReadDeadlines(H11Protocol):
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    send_timeout: float | None = None
    max_connections: int | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None
        self._reading_body = False
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            transport.write(_OVER_CAPACITY)
            transport.close()
            return
        self._arm(self.header_timeout)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        state = self.conn.their_state
        if state is h11.IDLE:
            return  # still waiting for a head: the header deadline runs
        if state is h11.SEND_BODY:
            if not self._reading_body:
                self._reading_body = True
                self._arm(self.body_timeout)
            return
        self._disarm()  # read whole (or closing): the answer is not timed

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._reading_body = False
            # the next request's head (a pipelined one is read below)
            self._arm(self.header_timeout)
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_timeout is not None and self._send_deadline is None:
            self._send_deadline = self.loop.call_later(self.send_timeout, self._send_expired)

    def resume_writing(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None
        super().resume_writing()

    def _send_expired(self) -> None:
        self._send_deadline = None
        # not close(): that would wait for the buffer the client does not read
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None
        super().connection_lost(exc)


def read_deadline_protocol(
    header_timeout: float,
    body_timeout: float,
    *,
    send_timeout: float | None = None,
    max_connections: int | None = None,
) -> type[H11Protocol]:
    return type(
        "ReadDeadlines",
        (_ReadDeadlines,),
        {
            "header_timeout": header_timeout,
            "body_timeout": body_timeout,
            "send_timeout": send_timeout,
            "max_connections": max_connections,
        },
    )


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit;
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return soft
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft
    return want


def connection_bound(wanted: int) -> int:
    """`wanted`, or half the open-file limit where that is less (see the module's docstring)."""
    limit = raise_open_files_limit()
    if limit == resource.RLIM_INFINITY or wanted <= limit // 2:
        return wanted
    bound = max(1, limit // 2)
    log.warning(
        "at most %d connections at once, not %d: the open-file limit is %d (raise ulimit -n)",
        bound,
        wanted,
        limit,
    )
    return bound


def serve_options(
    *,
    header_timeout: float,
    body_timeout: float,
    max_connections: int,
    keep_alive_s: float = 5.0,
    send_timeout: float | None = None,
) -> dict:
    """Keyword arguments for `serve` or `ServerThread` (see the module's docstring)."""
    bound = connection_bound(max_connections)
    protocol = read_deadline_protocol(
        header_timeout, body_timeout, send_timeout=send_timeout, max_connections=bound
    )
    # limit_concurrency counts the connection asking too:
    # one more, so every connection let in is served
    return {
        "http": protocol,
        "limit_concurrency": bound + 1,
        "timeout_keep_alive": keep_alive_s,
        "h11_max_incomplete_event_size": HEAD_BYTES,
    }


def serve(app, host: str, port: int, *, log_level: str, **options) -> None:
    """Serve `app` in this thread until SIGTERM or SIGINT."""
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_S, **options
    )


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class ServerThread:
    """`app` served by uvicorn on a thread and event loop of its own. The
    socket is bound here, so a port in use is an OSError to the caller and
    port 0's choice is `port` at once; `start` returns once it serves."""

    def __init__(
        self,
        app,
        host: str,
        port: int,
        *,
        name: str = "http",
        log_level: str = "warning",
        **options,
    ) -> None:
        self._sock = _listen(host, port)
        self.port: int = self._sock.getsockname()[1]
        # log_config=None: the process's logging stays its own; uvicorn's loggers propagate to it
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=GRACE_S,
            **options,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name=name, daemon=True
        )

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._sock.close()
                raise RuntimeError(f"the HTTP server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = GRACE_S + 5.0) -> None:
        """Stop accepting, close idle connections, give answers in progress `GRACE_S`, then end."""
        self._server.should_exit = True
        self._thread.join(timeout)
