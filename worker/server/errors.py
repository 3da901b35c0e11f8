"""Allocator and engine failures in the one error shape (pagedkv_base/api/errors.py).

They are mapped HERE and nowhere else (`failure`, `public_message`): a 503
with a short message of the worker's own words plus the gRPC status name and
details, never gRPC's debug string or an exception's repr.
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedkv_base.api.errors import install_error_handlers
from worker.engine import AllocatorFault, EngineDeadError

_DETAILS_CHARS = 200
# What must never reach a client: gRPC's debug string, an RpcError's repr.
_LEAK = re.compile(
    r"debug_error_string|_InactiveRpcError|_MultiThreadedRendezvous|<grpc\.|StatusCode\."
)


def _rpc_status(exc: BaseException | None) -> str | None:
    """`CODE: details` of the first gRPC error in `exc`'s chain (duck-typed: the
    worker never imports grpc), or None."""
    seen = 0
    while exc is not None and seen < 8:
        code, details = getattr(exc, "code", None), getattr(exc, "details", None)
        if callable(code) and callable(details):
            try:
                name = getattr(code(), "name", None) or str(code())
                text = " ".join(str(details() or "").split())
            except Exception:  # noqa: BLE001 - a half-built error: say no more than its type
                return None
            if len(text) > _DETAILS_CHARS:
                text = text[:_DETAILS_CHARS] + "..."
            return f"{name}: {text}" if text else name
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def public_message(exc: BaseException) -> str:
    """What a client may read about `exc`: the worker's own words, with the
    allocator's status (name and details) when it is an allocator failure."""
    if isinstance(exc, AllocatorFault):
        status = _rpc_status(exc.__cause__)
        return f"{exc} ({status})" if status else str(exc)
    if isinstance(exc, EngineDeadError):
        return "the engine thread died" if _LEAK.search(str(exc)) else str(exc)
    status = _rpc_status(exc)
    if status is not None:
        return f"the KV-cache allocator failed ({status})"
    text = str(exc)
    if _LEAK.search(text):
        return "the KV-cache allocator failed"
    return text


def failure(exc: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI-shaped body of a request the worker failed:
    503 for the allocator or a dead engine thread (the reason as the code), else 500."""
    if isinstance(exc, AllocatorFault | EngineDeadError):
        status, code = 503, exc.reason
    else:
        status, code = 500, None
    return status, {
        "error": {
            "message": public_message(exc),
            "type": "server_error",
            "param": None,
            "code": code,
        }
    }


async def _allocator_fault(_: Request, exc: AllocatorFault) -> JSONResponse:
    status, body = failure(exc)
    return JSONResponse(status_code=status, content=body, headers={"Retry-After": "5"})


def install_worker_error_handlers(app: FastAPI) -> None:
    """The shared handlers, and a 503 (with Retry-After) for an allocator failure."""
    install_error_handlers(app)
    app.add_exception_handler(AllocatorFault, _allocator_fault)
