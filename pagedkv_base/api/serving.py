"""Serving an app with uvicorn, with deadlines for reading each request.

Uvicorn times out only an idle kept-alive connection (`timeout_keep_alive`):
a client that opens a connection and sends its headers, or its body, a byte
at a time holds the connection, and its file descriptor, for as long as it
likes. `read_deadline_protocol` is uvicorn's own h11 protocol with two
deadlines: the request's headers must be in within `header_timeout` of the
connection opening (or of the previous answer on a kept-alive one), its
body within `body_timeout` after them; past either the connection is closed
(the app, if it was reading the body, sees the client gone). Once a request
is read whole nothing times out: an answer may take as long as it takes.

`serve_options` gives uvicorn the protocol with those deadlines, a bound on
concurrent connections and tasks (`limit_concurrency`: over it a request is
answered 503 at once, not queued), h11's bound on a request head
(`h11_max_incomplete_event_size`) and a keep-alive timeout.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_BYTES = 64 << 10  # the largest request line and headers read


class _ReadDeadlines(H11Protocol):
    header_timeout: float = 10.0
    body_timeout: float = 60.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading_body = False
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
            self._arm(self.header_timeout)  # the next request's head (a pipelined one is read below)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def read_deadline_protocol(header_timeout: float, body_timeout: float) -> type[H11Protocol]:
    return type("ReadDeadlines", (_ReadDeadlines,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})


def serve_options(*, header_timeout: float, body_timeout: float, max_connections: int,
                  keep_alive_s: float = 5.0) -> dict:
    """Keyword arguments for `uvicorn.run` (see the module's docstring)."""
    return {"http": read_deadline_protocol(header_timeout, body_timeout), "limit_concurrency": max_connections,
            "timeout_keep_alive": keep_alive_s, "h11_max_incomplete_event_size": HEAD_BYTES}
