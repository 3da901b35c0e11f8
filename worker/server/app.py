"""FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Errors leave in ONE shape, OpenAI's: `{"error": {"message", "type", "param",
"code"}}` with a 4xx status for anything the client sent wrong. `ApiError` is
raised anywhere in a handler; `install_error_handlers` maps it, pydantic's
validation errors and malformed JSON to that shape.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.engine import AsyncLLMEngine, RequestError, RequestOutput, SamplingError, SamplingParams
from worker.server.protocol import BaseRequest, ChatCompletionRequest, CompletionRequest

MAX_BODY_BYTES = 8 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code


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
                response = _error_body(413, f"request body larger than {self.max_bytes} bytes")
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


def _error_body(status: int, message: str, param=None, type_="invalid_request_error", code=None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type_, "param": param, "code": code}},
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError):
        return _error_body(exc.status, exc.message, exc.param, exc.type, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return _error_body(400, f"invalid JSON body: {first.get('ctx', {}).get('error', '')}".strip())
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error_body(400, f"{loc}: {first.get('msg', 'invalid value')}", param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return _error_body(exc.status_code, str(exc.detail), type_="not_found_error" if exc.status_code == 404 else "invalid_request_error")


def create_app(engine: AsyncLLMEngine, served_model_name: str) -> FastAPI:
    app = FastAPI(title="PagedKV worker", version="0.1.0")
    install_error_handlers(app)
    core = engine.engine
    created = int(time.time())

    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": core.num_running(), "waiting": core.num_waiting()}

    @app.get("/metrics")
    async def metrics():
        # In a thread: the pool gauges ask the allocator, which may be slow or
        # away, and /health and the API must not wait behind a scrape.
        body = await run_in_threadpool(generate_latest, core.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{
                "id": served_model_name, "object": "model", "created": created, "owned_by": "pagedkv",
                "max_model_len": core.max_model_len,
            }],
        }

    def check_common(req: BaseRequest, max_tokens: int | None) -> SamplingParams:
        if req.model != served_model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this worker serves {served_model_name!r}",
                           param="model", type_="not_found_error", code="model_not_found")
        if req.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                stop=req.stop_list(),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                cache_salt=req.cache_salt or None,
                priority=req.priority,
            )
        except SamplingError as exc:
            raise ApiError(400, str(exc)) from None

    async def start(prompt, params: SamplingParams, rid: str) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Submit and wait for the first output, so a refused request becomes a
        4xx before any byte of a stream is sent."""
        stream = engine.generate(prompt, params, rid)
        try:
            first = await stream.__anext__()
        except RequestError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        except RuntimeError as exc:
            raise ApiError(500, str(exc), type_="server_error") from None
        if first.finish_reason == "error":
            raise ApiError(400, first.error or "the request failed", param="prompt")
        return stream, first

    def usage(out: RequestOutput) -> dict:
        p, c = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    async def collect(stream, first: RequestOutput) -> RequestOutput:
        last = first
        if not first.finished:
            async for out in stream:
                last = out
        return last

    def sse(obj) -> bytes:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt or prompt == "":
            raise ApiError(400, "the prompt is empty", param="prompt")
        if req.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        params = check_common(req, req.max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream, first = await start(prompt, params, rid)
        if not req.stream:
            out = await collect(stream, first)
            return {
                "id": rid, "object": "text_completion", "created": int(time.time()), "model": served_model_name,
                "choices": [{"index": 0, "text": out.text, "finish_reason": _reason(out), "logprobs": None}],
                "usage": usage(out),
            }

        return StreamingResponse(_events(first, stream, rid, served_model_name, req, "text"), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        if req.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt_ids = core.tokenizer.encode_chat(messages, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None
        params = check_common(req, req.max_completion_tokens or req.max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream, first = await start(prompt_ids, params, rid)
        if not req.stream:
            out = await collect(stream, first)
            return {
                "id": rid, "object": "chat.completion", "created": int(time.time()), "model": served_model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "finish_reason": _reason(out), "logprobs": None}],
                "usage": usage(out),
            }
        return StreamingResponse(_events(first, stream, rid, served_model_name, req, "chat"), media_type="text/event-stream")

    async def _events(first: RequestOutput, stream, rid: str, model: str, req: BaseRequest, kind: str):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(choice: dict, **extra) -> bytes:
            return sse({"id": rid, "object": obj, "created": int(time.time()), "model": model,
                        "choices": [choice] if choice else [], **extra})

        def piece(out: RequestOutput) -> dict:
            reason = _reason(out) if out.finished else None
            if kind == "chat":
                return {"index": 0, "delta": {"content": out.new_text} if out.new_text else {},
                        "finish_reason": reason, "logprobs": None}
            return {"index": 0, "text": out.new_text, "finish_reason": reason, "logprobs": None}

        last = first
        try:
            if kind == "chat":
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            yield chunk(piece(first))
            if not first.finished:
                async for out in stream:
                    last = out
                    yield chunk(piece(out))
        finally:
            # Closing the stream before it finished aborts the request, which
            # frees its sequence at the next engine step.
            await stream.aclose()
        if req.include_usage():
            yield chunk({}, usage=usage(last))
        yield b"data: [DONE]\n\n"

    return app


def _reason(out: RequestOutput) -> str | None:
    if out.finish_reason in ("abort", "error"):
        return "stop" if out.finish_reason == "abort" else "error"
    return out.finish_reason

