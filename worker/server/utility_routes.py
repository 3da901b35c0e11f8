"""vLLM's utility routes: /tokenize, /detokenize, /version; and /reset_peaks.

Their request and response bodies are vLLM's:

- `POST /tokenize` with `{"prompt": "...", "add_special_tokens": true}` (a
  completion prompt) or `{"messages": [...], "add_generation_prompt": true,
  "add_special_tokens": false}` (a chat, rendered with the model's template
  as /v1/chat/completions renders it; `continue_final_message` is refused);
  `"model"` optional (404 if it names
  another model), `"return_token_strs": true` adds each token's text. Answer:
  `{"count", "max_model_len", "tokens", "token_strs"}`.
- `POST /detokenize` with `{"tokens": [ids]}`: `{"prompt": text}`.
- `GET /version`: `{"version": "..."}` (this package's version).
- `GET /pagedkv/identity?nonce=N`: the answer to a router's challenge
  (`allocator_service.wire.attest`): `{"pool_id", "worker_id", "proof"}`, proving
  that this worker serves the pool the allocator lists at its address; 404
  `not_registered` when no shared allocator lists it with an address.
- `POST /reset_peaks` (no body): starts the worker's high-water marks
  (`pagedkv_worker_*_peak` on /metrics) again, as a benchmark or the demo
  does before a run; answers the peaks until then, `{"kv_blocks_used",
  "kv_slots_holding_tokens", "running_sequences"}`. An admin route in vLLM's
  style (its `POST /reset_prefix_cache`): it changes only what /metrics
  shows, so it is open like /metrics.

Not under /v1, so an API key does not guard them (as in vLLM). A text
longer than `OFFLOAD_CHARS` (or more ids than that) is tokenized
(or decoded), and its answer built and serialized, off the event loop: a
multi-megabyte prompt's answer is millions of ids and strings.
"""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from allocator_service.wire.attest import IDENTITY_PATH, valid_nonce
from pagedkv_base.api.bodies import dumps, json_bytes, off_loop, read_body
from pagedkv_base.api.errors import ApiError
from pagedkv_base.api.protocol import ChatMessage, template_messages

router = APIRouter()


def version() -> str:
    try:
        return importlib.metadata.version("pagedkv")
    except importlib.metadata.PackageNotFoundError:
        # run from a source tree that was never installed
        return "0.0.0+unknown"


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest (exactly one of
    `prompt` and `messages`); `add_special_tokens` defaults as vLLM's do:
    true for a prompt, false for a chat (its template writes them)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def _check_model(request: Request, model: str | None) -> None:
    served = request.app.state.served_model_name
    if model is not None and model != served:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this worker serves {served!r}",
            param="model",
            type_="not_found_error",
            code="model_not_found",
        )


def _tokenize(core, req: TokenizeRequest) -> list[int]:
    tok = core.tokenizer
    if req.messages is None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        text = req.prompt
    else:
        special = bool(req.add_special_tokens)
        messages = template_messages(req.messages)
        try:
            text = tok.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise ApiError(
                400, f"cannot apply the chat template: {exc}", param="messages"
            ) from None
    try:
        return tok.encode(text, add_special_tokens=special)
    except Exception as exc:  # noqa: BLE001 - e.g. a lone surrogate
        raise ApiError(
            400, f"cannot tokenize: {exc}", param="prompt" if req.messages is None else "messages"
        ) from None


def _tokenize_answer(core, req: TokenizeRequest) -> bytes:
    ids = _tokenize(core, req)
    strs = [core.tokenizer.backend.id_to_token(i) for i in ids] if req.return_token_strs else None
    return dumps(
        {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids, "token_strs": strs}
    )


@router.post("/tokenize")
async def tokenize(request: Request):
    req = await read_body(request, TokenizeRequest)
    _check_model(request, req.model)
    if req.continue_final_message:
        raise ApiError(
            400, "continue_final_message is not supported", param="continue_final_message"
        )
    core = request.app.state.engine.engine
    size = (
        len(req.prompt) if req.prompt is not None else sum(len(m.text()) + 64 for m in req.messages)
    )
    return json_bytes(await off_loop(_tokenize_answer, core, req, size=size))


def _detokenize(core, ids: list[int]) -> bytes:
    vocab = core.loaded.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            400, f"token id {bad} is out of range: ids are in [0, {vocab})", param="tokens"
        )
    # as vLLM: every token
    return dumps({"prompt": core.tokenizer.decode(ids, skip_special_tokens=False)})


@router.post("/detokenize")
async def detokenize(request: Request):
    req = await read_body(request, DetokenizeRequest)
    _check_model(request, req.model)
    core = request.app.state.engine.engine
    return json_bytes(await off_loop(_detokenize, core, req.tokens, size=len(req.tokens)))


@router.post("/reset_peaks")
async def reset_peaks(request: Request):
    return request.app.state.engine.engine.metrics.peaks.reset()._asdict()


@router.get("/version")
async def get_version():
    return {"version": version()}


@router.get(IDENTITY_PATH)
async def identity(request: Request, nonce: str = ""):
    if not valid_nonce(nonce):
        raise ApiError(400, "nonce must be 32 to 128 lowercase hex digits", param="nonce")
    answer = request.app.state.engine.engine.allocator.identity(nonce)
    if answer is None:
        raise ApiError(
            404,
            "this worker's pool is not listed with an address by a shared allocator",
            type_="not_found_error",
            code="not_registered",
        )
    return answer
