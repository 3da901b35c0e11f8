"""The allocator's HTTP port: `/metrics` (Prometheus, the same bytes as
`prometheus_client.start_http_server`: its own handler serves them), the
live `/pools` page and its event stream, and `/playground`.

A `ThreadingHTTPServer` of its own (a thread per connection, none of the
gRPC threads), bounded: at most `MAX_CONNECTIONS` connections are served at
once (one more is answered 503 and closed at once, by the accepting thread),
and a client that sends nothing for `IDLE_TIMEOUT_S` (mid-request or between
requests) is closed, so idle or slow clients cannot pin threads, and the
threads that serve them, competing with gRPC's for the interpreter, stay
few. Pages are static files shipped in the package; the stream and the
small JSON calls are the only dynamic answers.

`/playground` (a teaching tool: it runs a simulation per call) answers only
when asked for (`start_web_server(playground=True)`: the allocator's
`--playground`, `pagedkv playground`), one run at a time (503 while another
runs).

Who may look: `/pools`, `/pools/stream` and `/pools/api/*` answer the
caller the `roles.py` table lets call `WatchEvents` (the admin or router
token; anyone when no token is configured), as a bearer token in the
`Authorization` header or, for the browser's `EventSource`, `?token=` in
the URL. `/metrics` and `/playground` (which holds nothing of the
service's pools) stay open, as `/metrics` was.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlparse

from prometheus_client.exposition import MetricsHandler

from allocator_service.errors import CapacityExceeded, PermissionDenied, Unauthenticated
from allocator_service.roles import ADMIN, ROUTER, Roles
from allocator_service.web import live, playground

log = logging.getLogger(__name__)

STATIC = resources.files("allocator_service.web") / "static"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}
PAGES = {"/pools": "pools.html", "/playground": "playground.html"}
MAX_BODY = 256 * 1024
MAX_CONNECTIONS = 32  # served at once (the /pools streams among them)
IDLE_TIMEOUT_S = 10.0  # a client silent this long is closed


def _static(name: str) -> bytes | None:
    if "/" in name or name.startswith("."):
        return None
    f = STATIC / name
    return f.read_bytes() if f.is_file() else None


class WebHandler(MetricsHandler):
    """Routes the pages, the stream and the JSON calls; anything else is
    `/metrics`, as every path was before (`MetricsHandler.do_GET`)."""

    service = None  # AllocatorService, or None: playground only
    roles = Roles()
    stopping = threading.Event()
    playground = False
    playground_turn = threading.Semaphore(1)  # one simulation at a time
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S  # on the socket: every read (and write) of a silent client times out

    # ------------------------------------------------------------ helpers
    def _send(self, status: int, body: bytes, content_type: str, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, value) -> None:
        self._send(status, json.dumps(value, separators=(",", ":")).encode(), "application/json")

    def _allowed(self, query: dict) -> bool:
        """The `roles.py` check of WatchEvents; answers 401/403 when refused."""
        header = self.headers.get("Authorization")
        bearer = header.encode() if header else None
        if bearer is None and query.get("token"):
            bearer = f"Bearer {query['token'][0]}".encode()
        roles = self.roles
        try:
            role = roles.check("WatchEvents", bearer)
            # With an admin or router token configured, only they may look,
            # even where the table leaves WatchEvents open to pools.
            if (roles.admin_token or roles.router_token) and role not in (ADMIN, ROUTER):
                raise (PermissionDenied if bearer is not None and role is not None else Unauthenticated)(
                    "the pools page needs the admin or router token")
        except Unauthenticated as exc:
            self._send(401, f"{exc}\n".encode(), "text/plain; charset=utf-8",
                       {"WWW-Authenticate": 'Bearer realm="pagedkv allocator"'})
            return False
        except PermissionDenied as exc:
            self._send(403, f"{exc}\n".encode(), "text/plain; charset=utf-8")
            return False
        return True

    # ------------------------------------------------------------ routes
    def do_GET(self) -> None:  # noqa: N802 (BaseHTTPRequestHandler's name)
        url = urlparse(self.path)
        path, query = url.path.rstrip("/") or "/", parse_qs(url.query)
        if path == "/playground" and not self.playground:
            self._send(404, b"not found: /playground is off on this port (the allocator's --playground)\n",
                       "text/plain")
        elif path in PAGES:
            if path == "/pools" and (self.service is None or not self._allowed(query)):
                if self.service is None:
                    self._send(404, b"no allocator in this process: /playground\n", "text/plain")
                return
            self._send(200, _static(PAGES[path]), _TYPES[".html"])
        elif path.startswith("/static/"):
            name = path[len("/static/"):]
            body = _static(name)
            if body is None:
                self._send(404, b"not found\n", "text/plain")
            else:
                self._send(200, body, _TYPES.get(name[name.rfind("."):], "application/octet-stream"))
        elif path == "/pools/stream":
            if self.service is not None and self._allowed(query):
                self._stream()
        elif path == "/pools/api/table":
            if self.service is not None and self._allowed(query):
                pool, seq = query.get("pool", [""])[0], query.get("seq", [""])[0]
                table = live.sequence_table(self.service, pool, seq)
                if table is None:
                    self._json(404, {"error": f"no sequence {seq!r} in pool {pool!r}"})
                else:
                    self._json(200, table)
        elif self.service is None or path == "/favicon.ico":
            self._send(404, b"not found\n", "text/plain")
        else:
            self.protocol_version = "HTTP/1.0"  # as before: the body ends with the connection
            self.close_connection = True
            super().do_GET()

    def do_POST(self) -> None:  # noqa: N802
        if urlparse(self.path).path != "/playground/api/run" or not self.playground:
            self._send(404, b"not found\n", "text/plain")
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self._json(413, {"error": f"the body is at most {MAX_BODY} bytes"})
            return
        body = self.rfile.read(length)
        if not self.playground_turn.acquire(blocking=False):
            self._json(503, {"error": "another playground run is in progress: try again"})
            return
        try:
            answer = playground.run(json.loads(body or b"{}"))
        except (ValueError, playground.PlaygroundError) as exc:
            self._json(400, {"error": str(exc)})
            return
        finally:
            self.playground_turn.release()
        self._json(200, answer)

    def _stream(self) -> None:
        service = self.service
        try:
            service.open_watcher()  # the WatchEvents limit counts these too
        except CapacityExceeded as exc:
            self._send(503, f"{exc}\n".encode(), "text/plain")
            return
        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"retry: 2000\n\n")
            self.wfile.flush()
            stop = lambda: self.stopping.is_set() or service.stopping  # noqa: E731
            for chunk in live.stream(service, stop):
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the page went away
        finally:
            service.close_watcher()

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        log.debug("%s %s", self.address_string(), format % args)


class WebServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    max_connections = MAX_CONNECTIONS

    def server_activate(self) -> None:
        self.slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()

    def process_request(self, request, client_address) -> None:
        """A thread for the connection while one of `max_connections` slots is
        free; else a 503 and the connection closed, without a thread."""
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
                                b"content-length: 29\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
                                b"too many connections at once\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def start_web_server(port: int, host: str = "0.0.0.0", *, registry=None, service=None,
                     roles: Roles | None = None, playground: bool = False) -> tuple[WebServer, threading.Thread]:
    """Serve on `host:port` (0: any free port) in a daemon thread; stop with
    `stop_web_server`. Without `service` only `/playground` (and its
    static files) answer; `/playground` only with `playground`."""
    import socket

    stopping = threading.Event()
    attrs = {"service": service, "roles": roles or Roles(), "stopping": stopping, "playground": playground,
             "playground_turn": threading.Semaphore(1)}
    if registry is not None:
        attrs["registry"] = registry
    handler = type("Handler", (WebHandler,), attrs)
    server_cls = WebServer
    if ":" in host:
        server_cls = type("WebServer6", (WebServer,), {"address_family": socket.AF_INET6})
    httpd = server_cls((host, port), handler)
    httpd.stopping = stopping
    thread = threading.Thread(target=httpd.serve_forever, name="http", daemon=True)
    thread.start()
    return httpd, thread


def stop_web_server(httpd: WebServer) -> None:
    httpd.stopping.set()  # open streams end at their next wake-up
    httpd.shutdown()
    httpd.server_close()
