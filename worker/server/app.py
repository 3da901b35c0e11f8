"""FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

`create_app` wires the pieces: the routes below (module-level handlers that
find the engine in `app.state`), the error shape and body limit (errors.py)
and server-sent events (streaming.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from worker.engine import AsyncLLMEngine, RequestError, RequestOutput, SamplingError, SamplingParams
from worker.server.errors import MAX_BODY_BYTES, ApiError, BodyLimit, install_error_handlers
from worker.server.protocol import (
    BaseRequest,
    ChatCompletionRequest,
    CompletionRequest,
    finish_reason,
    usage,
)
from worker.server.streaming import stream_events

router = APIRouter()


def create_app(engine: AsyncLLMEngine, served_model_name: str) -> FastAPI:
    app = FastAPI(title="PagedKV worker", version="0.1.0")
    app.state.engine = engine
    app.state.served_model_name = served_model_name
    app.state.created = int(time.time())
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.include_router(router)
    return app


@router.get("/health")
async def health(request: Request):
    core = request.app.state.engine.engine
    return {"status": "ok", "running": core.num_running(), "waiting": core.num_waiting()}


@router.get("/metrics")
async def metrics(request: Request):
    # In a thread: the pool gauges ask the allocator, which may be slow or
    # away, and /health and the API must not wait behind a scrape.
    body = await run_in_threadpool(generate_latest, request.app.state.engine.engine.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state
    return {
        "object": "list",
        "data": [{
            "id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "pagedkv",
            "max_model_len": state.engine.engine.max_model_len,
        }],
    }


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list) and not prompt or prompt == "":
        raise ApiError(400, "the prompt is empty", param="prompt")
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    return await _answer(request, req, prompt, req.max_tokens, f"cmpl-{uuid.uuid4().hex}", "text")


@router.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, request: Request):
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        prompt_ids = request.app.state.engine.engine.tokenizer.encode_chat(messages, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None
    max_tokens = req.max_completion_tokens or req.max_tokens
    return await _answer(request, req, prompt_ids, max_tokens, f"chatcmpl-{uuid.uuid4().hex}", "chat")


async def _answer(request: Request, req: BaseRequest, prompt, max_tokens: int | None, rid: str, kind: str):
    """Run the request; answer with one body, or a stream of events if asked."""
    model = request.app.state.served_model_name
    params = _sampling_params(req, max_tokens, model)
    stream, first = await _start(request.app.state.engine, prompt, params, rid)
    if req.stream:
        return StreamingResponse(stream_events(first, stream, rid, model, kind, req.include_usage()),
                                 media_type="text/event-stream")
    out = await _collect(stream, first)
    if kind == "chat":
        obj, choice = "chat.completion", {"index": 0, "message": {"role": "assistant", "content": out.text}}
    else:
        obj, choice = "text_completion", {"index": 0, "text": out.text}
    return {
        "id": rid, "object": obj, "created": int(time.time()), "model": model,
        "choices": [{**choice, "finish_reason": finish_reason(out), "logprobs": None}],
        "usage": usage(out),
    }


def _sampling_params(req: BaseRequest, max_tokens: int | None, served_model_name: str) -> SamplingParams:
    """The checks both endpoints share, then the engine's sampling parameters."""
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


async def _start(
    engine: AsyncLLMEngine, prompt, params: SamplingParams, rid: str
) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
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


async def _collect(stream: AsyncIterator[RequestOutput], first: RequestOutput) -> RequestOutput:
    last = first
    if not first.finished:
        async for out in stream:
            last = out
    return last
