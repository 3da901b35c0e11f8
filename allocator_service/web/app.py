"""The allocator's HTTP port: `/metrics` (Prometheus: the bytes
prometheus_client's own server gives), the live `/pools` page and its event
stream, and `/playground`.

An ASGI app served by uvicorn on a thread and event loop of its own
(`pagedkv_base.api.serving.ServerThread`), none of the gRPC server's
threads: an idle or slow client costs a socket, not a thread. Bounds
(`serving.serve_options`): at most `MAX_CONNECTIONS` connections (one more
is answered 503 and closed at once); a request's head within
`IDLE_TIMEOUT_S` of the connection opening or of the previous answer, its
body within `IDLE_TIMEOUT_S` after it; a client that takes nothing of an
answer for `IDLE_TIMEOUT_S` is cut off. `/pools/stream` answers are counted
with `WatchEvents` streams (`Limits.max_watchers`; 503 past it).

The event loop routes, checks tokens and copies bytes; what takes a pool's
lock (the metrics' collectors read every pool, a stream reads the pools it
shows, a block table) or runs a simulation runs in a worker thread: a
stream's in one of its own (there are at most `max_watchers`), the others in
one of `WORK_THREADS`. Pages are static files shipped in the package, read
once.

`/playground` (a teaching tool: it runs a simulation per call) answers only
when asked for (`start_web_server(playground=True)`: the allocator's
`--playground`, `pagedkv playground`), one run at a time (503 while another
runs).

Who may look: `/pools`, `/pools/stream` and `/pools/api/*` answer the
caller the `roles.py` table lets call `WatchEvents` (the admin or router
token; anyone when no token is configured), as a bearer token in the
`Authorization` header or, for the browser's `EventSource`, `?token=` in
the URL. `/metrics` and `/playground` (which holds nothing of the
service's pools) stay open.
"""

from __future__ import annotations

import asyncio
import json
import threading
from importlib import resources
from urllib.parse import parse_qs

import anyio
from prometheus_client import REGISTRY

# NOTE: prometheus_client's exposition itself (content negotiation, `name[]`,
# gzip), which its MetricsHandler and make_asgi_app both call; make_asgi_app
# would run it on the event loop, where the collectors' pool locks must not be.
from prometheus_client.exposition import _bake_output
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from allocator_service.roles import ADMIN, ROUTER, Roles
from allocator_service.web import live, playground
from allocator_service.wire.errors import CapacityExceeded, PermissionDenied, Unauthenticated
from pagedkv_base.api.serving import ServerThread, serve_options

STATIC = resources.files("allocator_service.web") / "static"
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}
PAGES = {"/pools": "pools.html", "/playground": "playground.html"}
MAX_BODY = 256 * 1024
MAX_CONNECTIONS = 2048  # open at once, the /pools streams among them
WORK_THREADS = 4  # metrics, block tables and playground runs at once (more wait their turn)
IDLE_TIMEOUT_S = 10.0  # a client that sends nothing, or takes nothing, this long is closed
_NO_STORE = {"Cache-Control": "no-store"}


def _text(status: int, body: str, extra: dict | None = None) -> Response:
    return Response(
        body.encode(), status, {**_NO_STORE, **(extra or {})}, "text/plain; charset=utf-8"
    )


def _json(status: int, value) -> Response:
    return Response(
        json.dumps(value, separators=(",", ":")).encode(), status, _NO_STORE, "application/json"
    )


def _run_playground(body: bytes) -> dict:
    return playground.run(json.loads(body or b"{}"))


class WebApp:
    """The ASGI app: routes the pages, the stream and the JSON calls; any
    other GET path is `/metrics`, as with prometheus_client's own server."""

    def __init__(
        self, *, registry=None, service=None, roles: Roles | None = None, playground: bool = False
    ):
        self.registry = registry if registry is not None else REGISTRY
        self.service = service  # AllocatorService, or None: playground only
        self.roles = roles or Roles()
        self.playground = playground
        self.stopping = threading.Event()  # open streams end at their next wake-up
        self._turn = threading.Lock()  # one simulation at a time
        self._work = anyio.CapacityLimiter(WORK_THREADS)
        self._static = {f.name: f.read_bytes() for f in STATIC.iterdir() if f.is_file()}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan is off; nothing else is served
            return
        request = Request(scope, receive)
        answer = await self._route(request)
        await answer(scope, receive, send)

    async def _route(self, request: Request):
        path = request.url.path.rstrip("/") or "/"
        query = parse_qs(request.url.query)
        if request.method == "POST":
            if path == "/playground/api/run" and self.playground:
                return await self._playground_run(request)
            return _text(404, "not found\n")
        if request.method != "GET":
            return _text(405, "only GET, and POST to /playground/api/run\n", {"Allow": "GET, POST"})
        if path == "/playground" and not self.playground:
            return _text(
                404, "not found: /playground is off on this port (the allocator's --playground)\n"
            )
        if path in PAGES or path.startswith("/pools/"):
            if path != "/playground" and self.service is None:
                return _text(404, "no allocator in this process: /playground\n")
            refused = None if path == "/playground" else self._refused(request, query)
            if refused is not None:
                return refused
            if path in PAGES:
                return Response(self._static[PAGES[path]], 200, _NO_STORE, _TYPES[".html"])
            if path == "/pools/stream":
                return _EventStream(self.service, self.stopping)
            if path == "/pools/api/table":
                pool, seq = query.get("pool", [""])[0], query.get("seq", [""])[0]
                table = await self._off_loop(live.sequence_table, self.service, pool, seq)
                if table is None:
                    return _json(404, {"error": f"no sequence {seq!r} in pool {pool!r}"})
                return _json(200, table)
            return _text(404, "not found\n")
        if path.startswith("/static/"):
            name = path[len("/static/") :]
            body = self._static.get(name)
            if body is None:
                return _text(404, "not found\n")
            return Response(
                body,
                200,
                _NO_STORE,
                _TYPES.get(name[name.rfind(".") :], "application/octet-stream"),
            )
        if self.service is None or path == "/favicon.ico":
            return _text(404, "not found\n")
        return await self._metrics(request, query)

    async def _off_loop(self, fn, *args):
        """`fn(*args)` in a worker thread, at most WORK_THREADS at once, so a
        flood of scrapes holds a few threads that compete with gRPC's, not one each."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._work)

    def _refused(self, request: Request, query: dict) -> Response | None:
        """The `roles.py` check of WatchEvents: None when allowed, else the 401/403."""
        header = request.headers.get("authorization")
        bearer = header.encode() if header else None
        if bearer is None and query.get("token"):
            bearer = f"Bearer {query['token'][0]}".encode()
        roles = self.roles
        try:
            role = roles.check("WatchEvents", bearer)
            # With an admin or router token configured, only they may look,
            # even where the table leaves WatchEvents open to pools.
            if (roles.admin_token or roles.router_token) and role not in (ADMIN, ROUTER):
                raise (
                    PermissionDenied if bearer is not None and role is not None else Unauthenticated
                )("the pools page needs the admin or router token")
        except Unauthenticated as exc:
            return _text(401, f"{exc}\n", {"WWW-Authenticate": 'Bearer realm="pagedkv allocator"'})
        except PermissionDenied as exc:
            return _text(403, f"{exc}\n")
        return None

    async def _metrics(self, request: Request, query: dict) -> Response:
        status, headers, body = await self._off_loop(
            _bake_output,
            self.registry,
            request.headers.get("accept"),
            request.headers.get("accept-encoding"),
            query,
            False,
        )
        return Response(body, int(status.split(" ", 1)[0]), dict(headers))

    async def _playground_run(self, request: Request) -> Response:
        declared = request.headers.get("content-length")
        if declared is not None and not (declared.isdigit() and int(declared) <= MAX_BODY):
            return _json(413, {"error": f"the body is at most {MAX_BODY} bytes"})
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                return _json(413, {"error": f"the body is at most {MAX_BODY} bytes"})
        if not self._turn.acquire(blocking=False):
            return _json(503, {"error": "another playground run is in progress: try again"})
        try:
            answer = await self._off_loop(_run_playground, bytes(body))
        except (ValueError, playground.PlaygroundError) as exc:
            return _json(400, {"error": str(exc)})
        finally:
            self._turn.release()
        return _json(200, answer)


class _EventStream:
    """`/pools/stream`: `live.stream`'s server-sent events, each produced in a
    worker thread (it waits on the event log and reads pools under their
    locks), until the client goes, the server stops or the service does."""

    def __init__(self, service, stopping: threading.Event) -> None:
        self.service, self.stopping = service, stopping

    async def __call__(self, scope, receive, send) -> None:
        service = self.service
        # NOTE: on the loop: the watcher count's lock is held for an increment only.
        try:
            service.streams.open_watcher()  # the WatchEvents limit counts these too
        except CapacityExceeded as exc:
            await _text(503, f"{exc}\n", {"Retry-After": "1"})(scope, receive, send)
            return
        gone = threading.Event()
        stop = lambda: gone.is_set() or self.stopping.is_set() or service.stopping  # noqa: E731
        events = live.stream(service, stop)
        watcher = asyncio.ensure_future(_until_disconnect(receive, gone))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"cache-control", b"no-store"),
                        (b"connection", b"close"),
                    ],
                }
            )
            chunk: bytes | None = b"retry: 2000\n\n"
            while chunk is not None and not gone.is_set():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await run_in_threadpool(next, events, None)
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.set()  # the generator, if a thread is still in it, returns at its next wake-up
            watcher.cancel()
            service.streams.close_watcher()


async def _until_disconnect(receive, gone: threading.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


class WebServer:
    """A started `WebApp` on uvicorn: `server_port`, and `stop_web_server`."""

    def __init__(self, app: WebApp, server: ServerThread) -> None:
        self.app, self.server = app, server
        self.server_port = server.port


def start_web_server(
    port: int,
    host: str = "0.0.0.0",
    *,
    registry=None,
    service=None,
    roles: Roles | None = None,
    playground: bool = False,
) -> WebServer:
    """Serve on `host:port` (0: any free port) on a thread of its own; stop
    with `stop_web_server`. Without `service` only `/playground` (and its
    static files) answer; `/playground` only with `playground`. A port that
    cannot be bound is an OSError here."""
    app = WebApp(registry=registry, service=service, roles=roles, playground=playground)
    options = serve_options(
        header_timeout=IDLE_TIMEOUT_S,
        body_timeout=IDLE_TIMEOUT_S,
        max_connections=MAX_CONNECTIONS,
        keep_alive_s=IDLE_TIMEOUT_S,
        send_timeout=IDLE_TIMEOUT_S,
    )
    return WebServer(app, ServerThread(app, host, port, **options).start())


def stop_web_server(httpd: WebServer) -> None:
    httpd.app.stopping.set()  # open streams end at their next wake-up
    httpd.server.stop()
