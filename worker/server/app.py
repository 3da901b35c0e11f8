"""FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
(and from utility_routes.py /tokenize, /detokenize, /version, /reset_peaks).

`create_app` wires the pieces: the routes below (module-level handlers that
find the engine in `app.state`), the error shape, body limit and API key
(`pagedkv_base.api.errors`, with the allocator's failures from errors.py),
request bodies off the loop (`pagedkv_base.api.bodies`) and server-sent
events (streaming.py).

The event loop does only cheap work, so /health answers under any input: a
body over `OFFLOAD_BYTES` is parsed and validated in a thread, prompts and
chat templates are tokenized in a thread (neither on the loop nor on the
engine thread), and a text that must have too many tokens is refused before
it is tokenized. A client that hangs up while its request waits or generates
has the request aborted, streaming or not.

With API keys every /v1/* route wants `Authorization: Bearer KEY` for one of
them (401 in OpenAI's error shape otherwise), and each key's requests are
cached under a salt of their own unless `cache_salt_per_api_key` is off
(`pagedkv_base.api.tenants`); /health, /metrics, /version, /tokenize and
/detokenize stay open, as in vLLM, and so does /reset_peaks.

With a `peer://` shared store the worker serves the entries it wrote on its
peer route (`POST /internal/kv/entries`, `worker.tiers.store.PeerStore`) to
callers presenting its store group's peer key, which the allocator gives only
to that group's pools; anyone else gets a 401, and a worker without a peer
store answers 404.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from allocator_service.core import InvalidArgument, check_cache_salt
from pagedkv_base.api.bodies import off_loop, read_body
from pagedkv_base.api.disconnect import ClientGone, unless_gone
from pagedkv_base.api.errors import MAX_BODY_BYTES, ApiError, ApiKeyCheck, BodyLimit
from pagedkv_base.api.protocol import (
    BaseRequest,
    ChatCompletionRequest,
    CompletionRequest,
    template_messages,
)
from pagedkv_base.api.tenants import tenant_of_request, tenant_salt
from worker.engine import (
    AllocatorFault,
    AsyncLLMEngine,
    RequestError,
    RequestOutput,
    SamplingError,
    SamplingParams,
)
from worker.server import utility_routes
from worker.server.answers import usage
from worker.server.errors import failure, install_worker_error_handlers, public_message
from worker.server.streaming import Choices, stream_events
from worker.tiers import PeerStore
from worker.tiers.store import PEER_ROUTE

router = APIRouter()


def create_app(
    engine: AsyncLLMEngine,
    served_model_name: str,
    root: str | None = None,
    api_key: str | Sequence[str] | None = None,
    cache_salt_per_api_key: bool = True,
) -> FastAPI:
    """The worker's HTTP app. `root`: what the model was loaded from (a path or
    repo id; /v1/models says it), default the served name. `api_key`: when
    set (one key or several), one is required on every /v1/* route, and with
    `cache_salt_per_api_key` each key's requests are cached under a salt of
    their own (`pagedkv_base.api.tenants`)."""
    app = FastAPI(title="PagedKV worker", version=utility_routes.version())
    app.state.engine = engine
    app.state.cache_salt_per_api_key = cache_salt_per_api_key
    app.state.served_model_name = served_model_name
    app.state.root = root or served_model_name
    app.state.created = int(time.time())
    install_worker_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    if api_key:  # added last, so it runs first: a request without the key is not even read
        app.add_middleware(ApiKeyCheck, api_keys=api_key)
    app.include_router(router)
    app.include_router(utility_routes.router)
    return app


MAX_PROMPTS = 256  # prompts in one batched completion request
T = TypeVar("T")


@router.get("/health")
async def health(request: Request):
    """200 when the worker can serve; 503 with the reason's code when the
    engine thread died (`engine_dead`) or the allocator refuses the pool or
    does not answer (`allocator_refused`, `allocator_unreachable`)."""
    engine: AsyncLLMEngine = request.app.state.engine
    core = engine.engine
    counts = {"running": core.num_running(), "waiting": core.num_waiting()}
    problem = engine.dead() or engine.problem()
    if problem is not None:
        body = {
            "status": "unavailable",
            "reason": public_message(problem),
            "code": problem.reason,
            **counts,
        }
        return JSONResponse(status_code=503, content=body, headers={"Retry-After": "5"})
    return {"status": "ok", **counts}


@router.post(PEER_ROUTE)
async def peer_entries(request: Request):
    """Entries of this worker's peer store, for another worker of its store
    group (module docstring): the body names the keys, one a line; the answer
    frames each entry or its absence (`store.frame_entries`)."""
    tiers = request.app.state.engine.engine.tiers
    mover = tiers.store if tiers is not None else None
    store = mover.store if mover is not None else None
    if not isinstance(store, PeerStore):
        return JSONResponse(status_code=404, content={"error": "no peer:// store here"})
    if not store.authorized(request.headers.get("authorization")):
        return JSONResponse(
            status_code=401, content={"error": "the peer route wants its store group's peer key"}
        )
    keys = (await request.body()).decode(errors="replace").split("\n")
    try:
        body = await run_in_threadpool(store.serve, keys)
    except ValueError as exc:
        return JSONResponse(status_code=400, content={"error": str(exc)})
    return Response(body, media_type="application/octet-stream")


@router.get("/metrics")
async def metrics(request: Request):
    # In a thread: the pool gauges ask the allocator, which may be slow or
    # away, and /health and the API must not wait behind a scrape.
    body = await run_in_threadpool(
        generate_latest, request.app.state.engine.engine.metrics.registry
    )
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    """vLLM's model card: `root` is what the model was loaded
    from, `max_model_len` the context limit."""
    state = request.app.state
    return {
        "object": "list",
        "data": [
            {
                "id": state.served_model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "pagedkv",
                "root": state.root,
                "parent": None,
                "max_model_len": state.engine.engine.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": state.created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }


@router.post("/v1/completions")
async def completions(request: Request):
    req = await read_body(request, CompletionRequest)
    _refuse_unsupported(req)
    req.check_sequences()
    if req.best_of is not None and req.best_of != req.n:
        # vLLM v1's answer too: only best_of == n (every sample returned) is served.
        raise ApiError(
            400,
            f"best_of must equal n ({req.n}) when set: returning the best {req.n} of "
            f"{req.best_of} samples is not supported",
            param="best_of",
        )
    _check_prompt_logprobs(req)
    core = request.app.state.engine.engine
    prompts = _prompt_list(req.prompt)
    ids = [
        await off_loop(_prompt_ids, core, p, size=len(p)) if isinstance(p, str) else p
        for p in prompts
    ]
    # vLLM: echo with logprobs asks for the prompt's logprobs (shown before the completion's)
    prompt_logprobs = (
        req.prompt_logprobs if req.prompt_logprobs is not None or not req.echo else req.logprobs
    )
    params = _sampling_params(
        req,
        req.max_tokens,
        request.app.state.served_model_name,
        core,
        req.logprobs,
        prompt_logprobs,
        _cache_salt(request, req),
    )
    echo = None
    if req.echo:  # a prompt's decode then the completion's text: the decode of prompt + output
        echo = await off_loop(
            _decode_all, core, ids, params.skip_special_tokens, size=4 * sum(map(len, ids))
        )
    return await _answer(request, req, ids, params, f"cmpl-{uuid.uuid4().hex}", "text", echo)


def _decode_all(core, prompts: list[list[int]], skip_special_tokens: bool) -> list[str]:
    return [core.tokenizer.decode(p, skip_special_tokens=skip_special_tokens) for p in prompts]


def _prompt_list(prompt) -> list[str | list[int]]:
    """A completion's prompts: one text, one token-id list, or a batch of either."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = list(prompt)
    else:
        prompts = [prompt]
    if not prompts or any(p == "" or p == [] for p in prompts):
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    return prompts


def _refuse_unsupported(req: BaseRequest) -> None:
    names = req.unsupported_fields()
    if names:
        raise ApiError(400, f"{names[0]} is not supported by this server", param=names[0])


def _check_prompt_logprobs(req: BaseRequest) -> None:
    """vLLM's rule: the `prompt_logprobs` field is not streamed (echo with
    logprobs is: the first chunk of each choice carries the prompt's)."""
    if req.stream and req.prompt_logprobs is not None:
        raise ApiError(
            400, "prompt_logprobs are not available when stream is enabled", param="prompt_logprobs"
        )


def _prompt_ids(core, text: str) -> list[int]:
    try:
        return core.encode_prompt(text)
    except RequestError as exc:
        raise ApiError(400, str(exc), param="prompt") from None


def _chat_ids(core, messages: list[dict]) -> list[int]:
    """The rendered chat template's ids (as `Tokenizer.encode_chat`), refused
    before tokenizing when it must be too long."""
    try:
        text = core.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None
    try:
        return core.encode_prompt(text, add_special_tokens=False)
    except RequestError as exc:
        raise ApiError(400, str(exc), param="messages") from None


@router.post("/v1/chat/completions")
async def chat(request: Request):
    req = await read_body(request, ChatCompletionRequest)
    _refuse_unsupported(req)
    req.check_sequences()
    if req.echo:
        raise ApiError(400, "echo is not supported on chat completions", param="echo")
    for i, m in enumerate(req.messages):
        what = m.unsupported()
        if what is not None:
            raise ApiError(
                400, f"messages[{i}].{what} is not supported by this server", param=f"messages[{i}]"
            )
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    _check_prompt_logprobs(req)
    messages = template_messages(req.messages)
    size = sum(len(m["content"]) for m in messages) + 64 * len(messages)
    core = request.app.state.engine.engine
    prompt_ids = await off_loop(_chat_ids, core, messages, size=size)
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling_params(
        req,
        max_tokens,
        request.app.state.served_model_name,
        core,
        logprobs,
        req.prompt_logprobs,
        _cache_salt(request, req),
    )
    return await _answer(request, req, [prompt_ids], params, f"chatcmpl-{uuid.uuid4().hex}", "chat")


async def _answer(
    request: Request,
    req: BaseRequest,
    prompts: list[list[int]],
    params: SamplingParams,
    rid: str,
    kind: str,
    echo: list[str] | None = None,
):
    """Run the request (one engine request per prompt, n samples each);
    answer with one body, or a stream of events if asked."""
    model = request.app.state.served_model_name
    engine: AsyncLLMEngine = request.app.state.engine
    limit = engine.engine.config.max_num_seqs
    if params.n > limit:  # the engine's rule (add_request), named for the client
        raise ApiError(
            400,
            f"n ({params.n}) exceeds max_num_seqs ({limit}): the samples of a request run together",
            param="n",
        )
    rids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    streams = [engine.generate(p, params, r) for p, r in zip(prompts, rids, strict=True)]
    try:
        # Until the first outputs (and for a whole answer, the last), a client
        # that hangs up aborts the request; a stream then notices by itself.
        firsts = await _unless_gone(request, streams, _all(*(_first(s) for s in streams)))
        choices = Choices(
            kind,
            params.n,
            engine.engine.tokenizer,
            params.skip_special_tokens,
            echo,
            req.return_token_ids,
        )
        if req.stream:
            return StreamingResponse(
                stream_events(firsts, streams, choices, rid, model, req.include_usage()),
                media_type="text/event-stream",
            )
        finals = await _unless_gone(
            request, streams, _all(*(_collect(s, f) for s, f in zip(streams, firsts, strict=True)))
        )
    except ClientGone:
        return Response(status_code=499)  # nobody reads it

    def body() -> dict:
        answer = {
            "id": rid,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                choices.whole(i, out) for i, per_prompt in enumerate(finals) for out in per_prompt
            ],
            "usage": usage([out for per_prompt in finals for out in per_prompt]),
        }
        if kind == "chat":  # vLLM: on the response for chat, on each choice for completions
            answer["prompt_logprobs"] = choices.prompt_logprobs(finals[0][0])
        return answer

    # Logprobs spell each position's tokens in context (a few decodes each): off the loop.
    spelled = params.logprobs is not None or params.prompt_logprobs is not None
    return await run_in_threadpool(body) if spelled else body()


def _cache_salt(request: Request, req: BaseRequest) -> str | None:
    """The salt the request's blocks are cached under: behind API keys (with
    `cache_salt_per_api_key`) one derived from its tenant (its key's, or the
    one a router named) and its own salt, else its own salt. A salt the
    allocator would refuse is a 400."""
    tenant = tenant_of_request(request)
    if tenant is None or not request.app.state.cache_salt_per_api_key:
        return req.cache_salt
    try:
        check_cache_salt(req.cache_salt)
    except InvalidArgument as exc:
        raise ApiError(400, str(exc), param="cache_salt") from None
    return tenant_salt(tenant, req.cache_salt)


def _sampling_params(
    req: BaseRequest,
    max_tokens: int | None,
    served_model_name: str,
    core,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    cache_salt: str | None = None,
) -> SamplingParams:
    """The checks both endpoints share, then the engine's sampling parameters:
    what the request sets, else the model's generation config, else the API's
    default; `cache_salt` as `_cache_salt` gives it."""
    if req.model != served_model_name:
        raise ApiError(
            404,
            f"the model {req.model!r} does not exist; this worker serves {served_model_name!r}",
            param="model",
            type_="not_found_error",
            code="model_not_found",
        )
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    defaults = core.loaded.sampling_defaults

    def pick(name: str, fallback):
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    vocab = core.loaded.config.vocab_size
    bias: list[tuple[int, float]] = []
    for key, value in (req.logit_bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise ApiError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not 0 <= tok < vocab:
            raise ApiError(
                400,
                f"logit_bias token id {tok} is outside the vocabulary [0, {vocab})",
                param="logit_bias",
            )
        bias.append((tok, value))
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            n=req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=tuple(bias),
            min_tokens=req.min_tokens,
            seed=req.seed,
            stop=req.stop_list(),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cache_salt=cache_salt,
            priority=req.priority,
        )
    except SamplingError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


async def _unless_gone(
    request: Request, streams: list[AsyncIterator[RequestOutput]], work: Awaitable[T]
) -> T:
    """`await work`, unless the client hangs up first: then the request is
    aborted (closing `streams` frees its sequences) and ClientGone raised.
    Work that fails closes the streams too (the other prompts of a batch)."""
    try:
        return await unless_gone(request, work)
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise


async def _all(*aws: Awaitable[T]) -> list[T]:
    """`asyncio.gather`, but the first failure cancels the rest (their
    streams then abort their requests)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first output, so a refused request becomes a 4xx (or a failed one a
    5xx) before any byte of a stream is sent."""
    try:
        first = await stream.__anext__()
    except RequestError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    except AllocatorFault:
        raise
    except RuntimeError as exc:
        raise _server_error(exc) from None
    if first.finish_reason == "error":
        raise ApiError(400, first.error or "the request failed", param="prompt")
    return first


def _server_error(exc: BaseException) -> ApiError:
    status, body = failure(exc)
    return ApiError(
        status, body["error"]["message"], type_="server_error", code=body["error"]["code"]
    )


async def _collect(
    stream: AsyncIterator[RequestOutput], first: RequestOutput
) -> list[RequestOutput]:
    """Every sample's last output, by index."""
    last = {first.index: first}
    if not first.request_finished:
        try:
            async for out in stream:
                last[out.index] = out
        except AllocatorFault:
            raise
        except RuntimeError as exc:  # the engine step failed
            raise _server_error(exc) from None
    return [last[i] for i in sorted(last)]
