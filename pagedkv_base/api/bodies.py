"""Request bodies off the event loop: a big body is parsed and validated in a
thread (`read_body`), a long text tokenized in one (`off_loop`), and a big
answer serialized in one (`dumps`, a long list a slice at a time, so the
thread lets the loop run between slices), so /health answers under any input
(worker/server/app.py says why)."""

from __future__ import annotations

import asyncio
import json
import os
import weakref
from typing import TypeVar

import anyio.to_thread
from anyio import CapacityLimiter
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

OFFLOAD_BYTES = 64 << 10  # bodies larger than this are parsed in a thread
OFFLOAD_CHARS = 4096  # prompts longer than this are tokenized in a thread
_SLICE = 1 << 14  # list items serialized at once (a few ms each, the GIL held)
Req = TypeVar("Req", bound=BaseModel)
# Threads doing this work at once, per event loop: more would only take turns
# at the GIL with the loop itself (each turn the loop waits for is /health's too).
HEAVY_THREADS = max(2, os.cpu_count() or 2)
_limiters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _limiter() -> CapacityLimiter:
    loop = asyncio.get_running_loop()
    limiter = _limiters.get(loop)
    if limiter is None:
        limiter = _limiters[loop] = CapacityLimiter(HEAVY_THREADS)
    return limiter


async def in_thread(fn, *args):
    """`fn(*args)` in a thread, at most `HEAVY_THREADS` at once."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=_limiter())


def _parse(body: bytes, content_type: str | None, model: type[Req]) -> Req:
    """The body as FastAPI would parse a `model` parameter (JSON unless the
    content type says otherwise), with the same validation errors."""
    data: object = body
    if not body:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    main, _, sub = (content_type or "application/json").split(";")[0].strip().lower().partition("/")
    if main == "application" and (sub == "json" or sub.endswith("+json")):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            raise RequestValidationError(
                [
                    {
                        "type": "json_invalid",
                        "loc": ("body", exc.pos),
                        "msg": "JSON decode error",
                        "input": {},
                        "ctx": {"error": exc.msg},
                    }
                ]
            ) from None
        except ValueError:  # not UTF-8 (or UTF-16/32) at all: FastAPI's words
            raise HTTPException(400, "There was an error parsing the body") from None
        except RecursionError:
            # nested deeper than the parser goes (FastAPI's own parse answers a 500)
            raise RequestValidationError(
                [
                    {
                        "type": "json_invalid",
                        "loc": ("body", 0),
                        "msg": "JSON decode error",
                        "input": {},
                        "ctx": {"error": "nested too deeply"},
                    }
                ]
            ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        ) from None


async def read_body(request: Request, model: type[Req]) -> Req:
    body = await request.body()
    content_type = request.headers.get("content-type")
    if len(body) <= OFFLOAD_BYTES:
        return _parse(body, content_type, model)
    return await in_thread(_parse, body, content_type, model)


async def off_loop(fn, *args, size: int):
    return fn(*args) if size <= OFFLOAD_CHARS else await in_thread(fn, *args)


def _dump(value, out: list[str]) -> None:
    if isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + json.dumps(str(key), ensure_ascii=False) + ":")
            _dump(item, out)
        out.append("}")
    elif isinstance(value, list) and len(value) > _SLICE:
        out.append("[")
        for i in range(0, len(value), _SLICE):
            part = json.dumps(
                value[i : i + _SLICE], ensure_ascii=False, allow_nan=False, separators=(",", ":")
            )
            out.append(("," if i else "") + part[1:-1])
        out.append("]")
    else:
        out.append(json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")))


def dumps(content: dict) -> bytes:
    """`content` (plain JSON values) as the bytes `JSONResponse` would send."""
    out: list[str] = []
    _dump(content, out)
    return "".join(out).encode()


def json_bytes(body: bytes, status_code: int = 200) -> Response:
    return Response(body, status_code=status_code, media_type="application/json")
