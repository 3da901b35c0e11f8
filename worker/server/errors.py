"""Errors leave in ONE shape, OpenAI's: `{"error": {"message", "type", "param",
"code"}}` with a 4xx status for anything the client sent wrong.

`ApiError` is raised anywhere in a handler; `install_error_handlers` maps it,
pydantic's validation errors, malformed JSON and unknown routes to that shape;
`BodyLimit` refuses oversized bodies in it before the app reads them, and
`ApiKeyCheck` a /v1/* request without the API key (401, code
`invalid_api_key`, as OpenAI answers) before anything else.

The shape is OpenAI's and vLLM's (`ErrorResponse{error: ErrorInfo}` since
vLLM 0.10); the values are OpenAI's: `type` like `invalid_request_error`,
`code` a string or null (vLLM puts the HTTP status there; the status line
says it here). The official client reads either.

Allocator failures are mapped HERE and nowhere else (`allocator_error`,
`public_message`): a 503 with a short message of the worker's own words plus
the gRPC status name and details, never gRPC's debug string or an exception's
repr.
"""

from __future__ import annotations

import re
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.engine import AllocatorError, EngineDeadError

MAX_BODY_BYTES = 8 << 20
_DETAILS_CHARS = 200
# What must never reach a client: gRPC's debug string, an RpcError's repr.
_LEAK = re.compile(r"debug_error_string|_InactiveRpcError|_MultiThreadedRendezvous|<grpc\.|StatusCode\.")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code


def error_response(status: int, message: str, param=None, type_="invalid_request_error", code=None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type_, "param": param, "code": code}},
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
    if isinstance(exc, AllocatorError):
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
    if isinstance(exc, AllocatorError | EngineDeadError):
        status, code = 503, exc.reason
    else:
        status, code = 500, None
    return status, {"error": {"message": public_message(exc), "type": "server_error", "param": None, "code": code}}


async def _allocator_error(_: Request, exc: AllocatorError) -> JSONResponse:
    status, body = failure(exc)
    return JSONResponse(status_code=status, content=body, headers={"Retry-After": "5"})


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.type, exc.code)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"invalid JSON body: {first.get('ctx', {}).get('error', '')}".strip())
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    return error_response(400, f"{loc}: {first.get('msg', 'invalid value')}", param=loc or None)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), type_="not_found_error" if exc.status_code == 404 else "invalid_request_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(AllocatorError, _allocator_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


class ApiKeyCheck:
    """Every request to /v1/* must carry `Authorization: Bearer <api_key>`
    (compared in constant time); others get a 401 in the one error shape.
    Other paths (/health, /metrics, /version, /tokenize, /detokenize) and
    CORS preflights pass, as in vLLM."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not _is_api(scope.get("path", "")):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if secrets.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        response = error_response(401, "invalid or missing API key: send the header `Authorization: Bearer KEY`",
                                  code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        return await response(scope, receive, send)


def _is_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class BodyLimit:
    """Refuse request bodies over `max_bytes` with a 413, whether they come
    with a content-length or chunked: the body is read (up to the limit)
    before the app sees it, then handed on unchanged."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                response = error_response(413, f"request body larger than {self.max_bytes} bytes")
                return await response(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)
