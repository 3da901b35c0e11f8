"""The HTTP protocol the worker and the router serve with
(`worker/server/http_protocol.py`): the writes of one event-loop turn leave
in one send, and nothing a client sees changes: whole answers, keep-alive,
streams whose events arrive as they are made, a refused body."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from worker.server.errors import BodyLimit
from worker.server.http_protocol import CoalescingH11Protocol, _CoalescingTransport


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 1234) if name == "peername" else default


def test_writes_of_one_turn_leave_together():
    async def scenario() -> FakeTransport:
        fake = FakeTransport()
        t = _CoalescingTransport(fake, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"")  # nothing to send: no write
        t.write(b"body")
        assert fake.writes == []  # not before the turn ends
        assert t.get_write_buffer_size() == 7 + len(b"HTTP/1.1 200 OK\r\n\r\nbody")
        await asyncio.sleep(0)
        assert fake.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        t.writelines([b"data: 1\n\n"])  # a later turn: a send of its own
        await asyncio.sleep(0)
        assert fake.writes[1:] == [b"data: 1\n\n"]
        assert t.get_extra_info("peername") == ("127.0.0.1", 1234)  # the rest is the transport's
        t.write(b"last")
        t.close()  # what was written before closing goes out first
        assert fake.writes[2:] == [b"last"] and fake.closed
        await asyncio.sleep(0)
        assert len(fake.writes) == 3  # the scheduled flush finds nothing left
        return fake

    asyncio.run(scenario())


def test_abort_drops_what_was_not_sent():
    async def scenario() -> None:
        fake = FakeTransport()
        t = _CoalescingTransport(fake, asyncio.get_running_loop())
        t.write(b"never")
        t.abort()
        await asyncio.sleep(0)
        assert fake.writes == [] and fake.aborted

    asyncio.run(scenario())


@pytest.fixture
def server():
    """A real uvicorn server with the protocol, on a free loopback port."""
    release = threading.Event()

    async def whole(request: Request):
        return JSONResponse({"echo": (await request.json())["x"]})

    async def events(request: Request):
        async def gen():
            yield b"data: first\n\n"
            # the next event only once the client has read the first: a
            # protocol that held the stream's bytes back would hang here
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
            yield b"data: second\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    app = BodyLimit(Starlette(routes=[Route("/whole", whole, methods=["POST"]),
                                      Route("/events", events)]), max_bytes=1024)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=CoalescingH11Protocol, log_level="warning",
                            lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", release
    finally:
        release.set()
        srv.should_exit = True
        thread.join(10)


def test_whole_answers_and_keep_alive(server):
    url, _ = server
    with httpx.Client(timeout=10) as client:
        for i in range(3):  # one connection, kept alive across answers
            r = client.post(f"{url}/whole", json={"x": i})
            assert r.status_code == 200 and r.json() == {"echo": i}
            assert r.headers["content-length"] == str(len(r.content))
        big = client.post(f"{url}/whole", content=b"x" * 2048)
        assert big.status_code == 413  # the refusal is written through the same transport


def test_stream_events_arrive_as_they_are_made(server):
    url, release = server
    with httpx.Client(timeout=10) as client, client.stream("GET", f"{url}/events") as r:
        lines = r.iter_lines()
        assert next(lines) == "data: first"  # before the server makes the second
        release.set()
        assert [line for line in lines if line] == ["data: second"]


class _Recorder:
    """The real transport, its writes recorded (under the coalescing one)."""

    def __init__(self, transport, writes: list[bytes]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name):
        return getattr(self._transport, name)


def test_one_send_per_whole_answer():
    """What reaches the socket: a whole answer's status line, headers and
    body in one write (uvicorn's own protocol makes two: head, then body)."""
    writes: list[bytes] = []

    class Recording(CoalescingH11Protocol):
        def connection_made(self, transport):
            super().connection_made(_Recorder(transport, writes))

    async def whole(request: Request):
        return JSONResponse({"ok": True})

    config = uvicorn.Config(Starlette(routes=[Route("/whole", whole, methods=["POST"])]), host="127.0.0.1", port=0,
                            http=Recording, log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        port = srv.servers[0].sockets[0].getsockname()[1]
        with httpx.Client(timeout=10) as client:
            for _ in range(2):
                assert client.post(f"http://127.0.0.1:{port}/whole", json={}).json() == {"ok": True}
    finally:
        srv.should_exit = True
        thread.join(10)
    assert len(writes) == 2  # one per answer
    assert all(w.startswith(b"HTTP/1.1 200") and w.endswith(b'{"ok":true}') for w in writes)
