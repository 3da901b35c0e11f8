"""`BadWorker`: a loopback server speaking just enough HTTP/1.1 to fail a router in one chosen
way, and, given a pool's proof, to pass for that pool's worker."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable

from allocator_service.wire.attest import IDENTITY_PATH

BAD_MODES = (
    "503",
    "drop-body",
    "drop-stream",
    "silent",
    "huge",
    "huge-declared",
    "trickle",
    "trickle-stream",
    "record",
)


HUGE_BYTES = 300 << 20


class BadWorker:
    """An HTTP server on 127.0.0.1 that fails every POST in one way:
    `503` (answers Service Unavailable), `drop-body` (sends a 200 whose
    declared body never fully arrives), `drop-stream` (sends one SSE event,
    then closes), `silent` (reads the request and never answers), `huge` (a 200 whose
    body goes on for `huge_bytes`), `huge-declared` (a 200 that says its body is `huge_bytes`),
    `trickle` (a 200 whose body comes a byte at a time), `trickle-stream` (an event
    stream that sends a byte at a time and never ends an event), `record` (answers a
    completion and keeps each request's headers in `heads`); mode `by-prompt`: each
    request's prompt names its mode. `GET /pagedkv/identity?nonce=N` answers what
    `identity(N)` returns (a pool's proof, e.g. `GrpcAllocator.identity`) when it is
    set; other GETs answer 404. `sock`: a listening socket to serve on (its own, from
    the caller, e.g. for an address bound to a worker token), else a free port;
    `model`: the model its answers name."""

    def __init__(
        self,
        mode: str,
        *,
        sock: socket.socket | None = None,
        huge_bytes: int = HUGE_BYTES,
        identity: Callable[[str], dict | None] | None = None,
        model: str = "tiny-random",
    ) -> None:
        if mode not in (*BAD_MODES, "by-prompt"):
            raise ValueError(
                f"mode must be one of {', '.join(BAD_MODES)} or by-prompt, not {mode!r}"
            )
        self.mode = mode
        self.model = model
        self.sock = sock
        self.huge_bytes = huge_bytes
        self.identity = identity
        self.posts = 0
        self.heads: list[dict[str, str]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BadWorker:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("the bad worker did not start within 10 s")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        where = {"sock": self.sock} if self.sock is not None else {"host": "127.0.0.1", "port": 0}
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, **where))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(self.loop)  # answers still being sent: ended, not left pending
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()

    def _mode_of(self, body: bytes) -> str:
        if self.mode != "by-prompt":
            return self.mode
        try:
            mode = json.loads(body).get("prompt")
        except (ValueError, AttributeError):
            mode = None
        return mode if mode in BAD_MODES else "503"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = next(
                (
                    int(v)
                    for k, _, v in (h.partition(":") for h in lines[1:])
                    if k.strip().lower() == "content-length"
                ),
                0,
            )
            body = await reader.readexactly(length)
            if not lines[0].startswith("POST"):
                target = lines[0].split(" ")[1] if lines[0].count(" ") >= 2 else ""
                path, _, query = target.partition("?")
                if path == IDENTITY_PATH and self.identity is not None:
                    nonce = next(
                        (
                            v
                            for k, _, v in (q.partition("=") for q in query.split("&"))
                            if k == "nonce"
                        ),
                        "",
                    )
                    answer = json.dumps(self.identity(nonce)).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(answer), answer)
                    )
                else:
                    writer.write(
                        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    )
                return
            self.posts += 1
            self.heads.append(
                {
                    k.strip().lower(): v.strip()
                    for k, _, v in (h.partition(":") for h in lines[1:] if h)
                }
            )
            mode = self._mode_of(body)
            if mode == "record":
                answer = json.dumps(
                    {
                        "id": "cmpl-rec",
                        "object": "text_completion",
                        "created": 0,
                        "model": self.model,
                        "choices": [
                            {"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n%s" % (len(answer), answer)
                )
            elif mode == "503":
                answer = b'{"error": {"message": "overloaded"}}'
                writer.write(
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(answer), answer)
                )
            elif mode == "silent":  # takes the request and computes "forever"
                await reader.read()
            elif mode in ("huge", "huge-declared"):
                declared = (
                    b"content-length: %d\r\n" % self.huge_bytes if mode == "huge-declared" else b""
                )
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + declared + b"\r\n"
                )
                block = b" " * (1 << 20)
                for _ in range(self.huge_bytes >> 20):
                    # until the router stops reading (its bound) or all is sent
                    writer.write(block)
                    await writer.drain()
            elif mode in ("trickle", "trickle-stream"):
                kind = b"text/event-stream" if mode == "trickle-stream" else b"application/json"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: 100000\r\n\r\n" % kind
                )
                for _ in range(100000):
                    writer.write(b"d")
                    await writer.drain()
                    await asyncio.sleep(0.1)
            elif mode == "drop-body":
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: 500\r\n\r\n"
                    b'{"id": "cmpl-cut", "choices": ['
                )
            else:  # drop-stream
                event = {
                    "id": "cmpl-cut",
                    "object": "text_completion",
                    "model": self.model,
                    "choices": [
                        {"index": 0, "text": "partial", "logprobs": None, "finish_reason": None}
                    ],
                }
                chunk = f"data: {json.dumps(event)}\n\n".encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(chunk), chunk)
                )
                # Dies a while after its first event, as a worker would; bytes that come
                # in the same read as the loss of the connection are not passed on (the
                # client library raises before it hands over what it buffered).
                await writer.drain()
                await asyncio.sleep(0.3)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            # (cancelled: the server stops; Python 3.11's stream callback fails on a cancelled task)
            pass
        finally:
            writer.close()
