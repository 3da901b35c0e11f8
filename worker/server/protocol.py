"""Request bodies of the OpenAI-style API (the fields PagedKV honours, with
vLLM's extra sampling fields), the fields it refuses, and the pieces whole and
streamed answers share (usage, finish reason, logprobs).

A sampling field left out is None here, so the model's own default
(`generation_config.json`) can apply before the API's. A field PagedKV does not
implement (`tools`, `response_format`, ...) is a 400 naming it, never ignored
(`unsupported_fields`); other unknown fields are ignored, as OpenAI-compatible
servers do, so the official client's bookkeeping fields (`user`, `store`,
`metadata`) never fail a request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from worker.engine import RequestOutput
    from worker.engine.sampling import Logprobs

# Fields of OpenAI's or vLLM's API that change what a request means and that
# PagedKV does not implement: a request that sets one (to anything but null)
# is refused with a 400 naming it.
UNSUPPORTED_FIELDS = (
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
    "suffix", "audio", "modalities", "prediction", "web_search_options", "reasoning_effort",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structured_outputs", "use_beam_search", "length_penalty",
    "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "prompt_embeds", "logits_processors",
    "return_tokens_as_token_ids", "chat_template", "chat_template_kwargs", "documents",
    "continue_final_message", "mm_processor_kwargs", "kv_transfer_params",
    "vllm_xargs", "spaces_between_special_tokens", "add_special_tokens", "add_generation_prompt",
)


class BaseRequest(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: dict | None = None
    cache_salt: str | None = None
    priority: int = 0
    user: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: top logprobs of every prompt token (not streamed)

    def unsupported_fields(self) -> list[str]:
        """The fields this request sets that PagedKV does not implement."""
        extra = self.model_extra or {}
        return [name for name in UNSUPPORTED_FIELDS
                if extra.get(name, getattr(self, name, None) if name in type(self).model_fields else None) is not None]

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(BaseRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def unsupported(self) -> str | None:
        """The first part of this message a text model without tools cannot take."""
        extra = self.model_extra or {}
        for name in ("tool_calls", "function_call", "audio"):
            if extra.get(name) is not None:
                return name
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text":
                    return f"content (a {part.type!r} part)"
        return None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """What the chat template renders: each message's role and text. The one
    conversion, so the worker, its /tokenize and the router hash the same ids."""
    return [{"role": m.role, "content": m.text()} for m in messages]


class ChatCompletionRequest(BaseRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    echo: bool = False  # vLLM's: echo the last message; not implemented (400)


def usage(outs: list[RequestOutput]) -> dict:
    """Usage of a request's final outputs: every prompt once, every sample's tokens."""
    seen: dict[str, RequestOutput] = {}
    for out in outs:
        seen.setdefault(out.request_id, out)
    p = sum(len(o.prompt_token_ids) for o in seen.values())
    c = sum(len(o.token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in seen.values())
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(out: RequestOutput) -> str | None:
    """The engine's reason in OpenAI's words: an aborted request just stopped."""
    if out.finish_reason in ("abort", "error"):
        return "stop" if out.finish_reason == "abort" else "error"
    return out.finish_reason


def completion_logprobs(entries: list[Logprobs | None], token_ids: list[int], texts: list[dict[int, str]],
                        widths: list[int], offset: int = 0) -> dict:
    """The completions shape: `tokens`, `token_logprobs`, `top_logprobs`
    (the top ones plus the chosen token, as vLLM), `text_offset`. Per
    position, `texts` spells the chosen and top tokens as they read there and
    `widths` is how much of the choice's text the chosen token adds."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, lp, spelled, width in zip(token_ids, entries, texts, widths, strict=True):
        tokens.append(spelled[tok])
        offsets.append(offset)
        offset += width
        if lp is None:  # the first prompt token
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(max(lp.logprob, -9999.0))
        top: dict[str, float] = {}
        for t, v in [*lp.top, (tok, lp.logprob)]:  # tokens that share a spelling: the likeliest
            top.setdefault(spelled[t], max(v, -9999.0))
        tops.append(top)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


def prompt_logprobs_json(entries: list[Logprobs | None] | None, texts: list[dict[int, str]] | None
                         ) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else
    token id -> {logprob, rank, decoded_token} for the prompt token and the
    top ones (ranks 1, 2, ...); `texts` spells them per position."""
    if entries is None or texts is None:
        return None

    def item(lp: float, rank: int, tok: int, spelled: dict[int, str]) -> dict:
        return {"logprob": max(lp, -9999.0), "rank": rank, "decoded_token": spelled[tok]}

    out: list[dict | None] = []
    for e, spelled in zip(entries, texts, strict=True):
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): item(e.logprob, e.rank, e.token_id, spelled)}
        for rank, (t, v) in enumerate(e.top, start=1):
            d.setdefault(str(t), item(v, rank, t, spelled))
        out.append(d)
    return out


def chat_logprobs(entries: list[Logprobs], texts: list[dict[int, str]]) -> dict:
    """The chat shape: `{"content": [{token, logprob, bytes, top_logprobs}]}`;
    `texts` spells the tokens per position."""
    def item(tok: int, lp: float, spelled: dict[int, str]) -> dict:
        text = spelled[tok]
        return {"token": text, "logprob": max(lp, -9999.0), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob, spelled), "top_logprobs": [item(t, v, spelled) for t, v in e.top]}
                        for e, spelled in zip(entries, texts, strict=True)]}
