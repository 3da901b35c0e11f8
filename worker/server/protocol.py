"""Request bodies of the OpenAI-style API (the fields PagedKV honours), and
the pieces whole and streamed answers share (usage, finish reason).

Unknown fields are ignored, as OpenAI-compatible servers do, so the official
client's extra fields never fail a request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from worker.engine import RequestOutput


class BaseRequest(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    cache_salt: str | None = None
    priority: int = 0
    user: str | None = None

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


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # content parts: only text parts are understood by a text model
        return "".join(p.text or "" for p in self.content if p.type == "text")


class ChatCompletionRequest(BaseRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


def usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def finish_reason(out: RequestOutput) -> str | None:
    """The engine's reason in OpenAI's words: an aborted request just stopped."""
    if out.finish_reason in ("abort", "error"):
        return "stop" if out.finish_reason == "abort" else "error"
    return out.finish_reason
