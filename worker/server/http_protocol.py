"""uvicorn's HTTP/1.1 protocol with each answer's bytes sent together.

uvicorn writes a response's status line and headers to the socket as soon as
the app starts the response, then its body in a second write. On loopback
and in a VM each write that finds the peer asleep wakes it: the peer wakes
for the headers, finds no body, sleeps and wakes again. A whole answer
(JSON, an error) costs its reader two wake-ups instead of one, and behind
the router every request pays that twice (worker to router, router to
client). `CoalescingH11Protocol` holds the writes made in one turn of the
event loop and sends them as one at the end of that turn: a whole answer
leaves in one write, a stream's events still leave as soon as each is made
(one turn later, microseconds), and nothing else changes (flow control,
keep-alive, closing: the real transport's, untouched).

Both the worker and the router serve with it (`uvicorn.run(...,
http=CoalescingH11Protocol)`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class _CoalescingTransport:
    """A transport whose writes within one loop turn leave in one send;
    everything else is the wrapped transport's."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def writelines(self, chunks) -> None:
        for chunk in chunks:
            self.write(chunk)

    def _flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()  # what the app wrote before closing still goes out
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingH11Protocol(H11Protocol):
    """uvicorn's h11 protocol over a `_CoalescingTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
