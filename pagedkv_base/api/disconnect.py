"""A client that hangs up while its answer is being made: noticed, so the
work for it stops (the worker aborts the request and frees its blocks; the
router closes its connection to the worker, which then does the same).
A stream notices by itself (Starlette's StreamingResponse listens); a whole
answer is awaited through `unless_gone`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read: the next message
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client hangs up first: then `work` is
    cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone
    return task.result()
