"""Request bodies of the OpenAI-style API (the fields PagedKV honours, with
vLLM's extra sampling fields) and the fields it refuses: the worker and the
router parse a request with these same models, so both give the same 400.

A sampling field left out is None here, so the model's own default
(`generation_config.json`) can apply before the API's. A field PagedKV does not
implement (`tools`, `response_format`, ...) is a 400 naming it, never ignored
(`unsupported_fields`); other unknown fields are ignored, as OpenAI-compatible
servers do, so the official client's bookkeeping fields (`user`, `store`,
`metadata`) never fail a request.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedkv_base.api.errors import ApiError

# The sequences one request may ask for (its prompts times n): the worker and
# the router refuse more with a 400 before any is computed (vLLM serves at most
# max_num_seqs, 256 to 1024, at once).
MAX_SEQUENCES = 512

# Fields of OpenAI's or vLLM's API that change what a request means and that
# PagedKV does not implement: a request that sets one (to anything but null)
# is refused with a 400 naming it.
UNSUPPORTED_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "suffix",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "reasoning_effort",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structured_outputs",
    "use_beam_search",
    "length_penalty",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "prompt_embeds",
    "logits_processors",
    "return_tokens_as_token_ids",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "continue_final_message",
    "mm_processor_kwargs",
    "kv_transfer_params",
    "vllm_xargs",
    "spaces_between_special_tokens",
    "add_special_tokens",
    "add_generation_prompt",
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
    # vLLM's: each choice carries its generated ids (`token_ids`; streamed: this chunk's); a
    # completion's choice also its prompt's (`prompt_token_ids`)
    return_token_ids: bool = False

    def unsupported_fields(self) -> list[str]:
        """The fields this request sets that PagedKV does not implement."""
        extra = self.model_extra or {}
        return [
            name
            for name in UNSUPPORTED_FIELDS
            if extra.get(
                name, getattr(self, name, None) if name in type(self).model_fields else None
            )
            is not None
        ]

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def prompts(self) -> int:
        return 1

    def check_sequences(self) -> int:
        """The sequences the request asks for (prompts times n); a 400 when more than
        `MAX_SEQUENCES`."""
        asked = self.prompts() * max(self.n, 1)
        if asked > MAX_SEQUENCES:
            raise ApiError(
                400,
                f"a request may ask for at most {MAX_SEQUENCES} sequences (prompts times n); "
                f"this one asks for {asked} ({self.prompts()} prompts, n={self.n})",
                param="n",
            )
        return asked


class CompletionRequest(BaseRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    def prompts(self) -> int:
        """How many prompts: one text or id list, or a batch of them."""
        p = self.prompt
        return len(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else 1


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
