"""Errors leave in ONE shape, OpenAI's: `{"error": {"message", "type", "param",
"code"}}` with a 4xx status for anything the client sent wrong.

`ApiError` is raised anywhere in a handler; `install_error_handlers` maps it,
pydantic's validation errors, malformed JSON and unknown routes to that shape;
`BodyLimit` refuses oversized bodies in it before the app reads them, and
`ApiKeyCheck` a /v1/* request without the API key (401, code
`invalid_api_key`, as OpenAI answers) before anything else. The worker and the
router install the same handlers, so a client meets one shape at either door.

The shape is OpenAI's and vLLM's (`ErrorResponse{error: ErrorInfo}` since
vLLM 0.10); the values are OpenAI's: `type` like `invalid_request_error`,
`code` a string or null (vLLM puts the HTTP status there; the status line
says it here). The official client reads either.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

MAX_BODY_BYTES = 8 << 20


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type_,
            code,
        )
        self.headers = headers  # sent with the answer (a 429's Retry-After)


def error_response(
    status: int, message: str, param=None, type_="invalid_request_error", code=None
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type_, "param": param, "code": code}},
    )


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    response = error_response(exc.status, exc.message, exc.param, exc.type, exc.code)
    response.headers.update(exc.headers or {})
    return response


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return error_response(
            400, f"invalid JSON body: {first.get('ctx', {}).get('error', '')}".strip()
        )
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    return error_response(400, f"{loc}: {first.get('msg', 'invalid value')}", param=loc or None)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(
        exc.status_code,
        str(exc.detail),
        type_="not_found_error" if exc.status_code == 404 else "invalid_request_error",
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


class ApiKeyCheck:
    """Every request to /v1/*, /tokenize and /detokenize must carry
    `Authorization: Bearer KEY` for one of `api_keys` (each compared in
    constant time); others get a 401 in the one error shape. The key it came
    with is the request's `state.api_key` (`tenants.api_key_of`). /health,
    /metrics, /version and CORS preflights pass, as in vLLM; unlike vLLM the
    tokenizer routes want the key too, since a long text costs seconds of CPU
    and an answer several times its size."""

    def __init__(self, app, api_keys: str | Sequence[str]) -> None:
        self.app = app
        keys = (api_keys,) if isinstance(api_keys, str) else tuple(api_keys)
        self._expected = [(f"Bearer {key}".encode(), key) for key in keys]

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or not _is_api(scope.get("path", ""))
        ):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        found = None
        for expected, key in self._expected:  # every key compared, whichever matches
            if secrets.compare_digest(given, expected):
                found = key
        if found is not None:
            scope.setdefault("state", {})["api_key"] = found
            return await self.app(scope, receive, send)
        response = error_response(
            401,
            "invalid or missing API key: send the header `Authorization: Bearer KEY`",
            code="invalid_api_key",
        )
        response.headers["WWW-Authenticate"] = "Bearer"
        return await response(scope, receive, send)


def _is_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


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
