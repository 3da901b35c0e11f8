"""Choices of an answer, whole or as server-sent events: one chunk per engine
output, then `data: [DONE]`.

A request's choices are its prompts times its samples: choice
`prompt_index * n + sample_index`, as vLLM and OpenAI number them. Chat streams
open with the assistant role, once per choice; with
`stream_options.include_usage` a last chunk carries the usage. Closing the
stream early aborts the request. A request that fails after its first chunk
(the allocator gave up, an engine step failed) ends with an OpenAI-shaped
`{"error": ...}` event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable

from worker.engine import RequestOutput
from worker.server.answers import (
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    prompt_logprobs_json,
    usage,
)
from worker.server.errors import failure


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class Choices:
    """How one request's outputs become choices (whole, or streamed deltas)."""

    def __init__(self, kind: str, n: int, decode: Callable[[int], str], echo: list[str] | None = None) -> None:
        self.kind = kind  # "chat" or "text"
        self.n = n
        self.decode = decode
        self.echo = echo  # per prompt: its text, shown before the completion
        self._offsets: dict[int, int] = {}  # streamed text per choice so far (text_offset)

    def index(self, prompt_index: int, out: RequestOutput) -> int:
        return prompt_index * self.n + out.index

    def whole(self, prompt_index: int, out: RequestOutput) -> dict:
        index = self.index(prompt_index, out)
        logprobs = None
        if self.kind == "chat":
            if out.logprobs is not None:
                logprobs = chat_logprobs(out.logprobs, self.decode)
            choice = {"index": index, "message": {"role": "assistant", "content": out.text}}
        else:
            text = out.text
            if self.echo is not None:
                text = self.echo[prompt_index] + text
            if out.logprobs is not None:
                logprobs = completion_logprobs(*self._echoed(out, out.logprobs, out.token_ids[: len(out.logprobs)]),
                                               self.decode)
            choice = {"index": index, "text": text,
                      "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs, self.decode)}
        return {**choice, "logprobs": logprobs, "finish_reason": finish_reason(out), "stop_reason": out.stop_reason}

    def _echoed(self, out: RequestOutput, entries: list, token_ids: list[int]) -> tuple[list, list[int]]:
        """With echo, the prompt's logprobs and tokens before the completion's
        (its first token's logprob None), as vLLM answers echo with logprobs."""
        if self.echo is None or out.prompt_logprobs is None:
            return entries, token_ids
        return [*out.prompt_logprobs, *entries], [*out.prompt_token_ids, *token_ids]

    def delta(self, prompt_index: int, out: RequestOutput) -> dict:
        index = self.index(prompt_index, out)
        reason = finish_reason(out) if out.finished else None
        stop_reason = out.stop_reason if out.finished else None
        new = out.new_logprobs
        logprobs = None
        if self.kind == "chat":
            if new is not None:
                logprobs = chat_logprobs(new, self.decode)
            return {"index": index, "delta": {"content": out.new_text} if out.new_text else {},
                    "logprobs": logprobs, "finish_reason": reason, "stop_reason": stop_reason}
        text = out.new_text
        first = index not in self._offsets
        if first and self.echo is not None:
            text = self.echo[prompt_index] + text
        offset = self._offsets.get(index, 0)
        if new is not None:
            entries, ids = self._echoed(out, new, out.new_token_ids) if first else (new, out.new_token_ids)
            logprobs = completion_logprobs(entries, ids, self.decode, offset)
            offset += sum(len(t) for t in logprobs["tokens"])
        self._offsets[index] = offset
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": stop_reason}


async def merge(firsts: list[RequestOutput], streams: list[AsyncIterator[RequestOutput]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every prompt's stream, as they come."""
    for i, first in enumerate(firsts):
        yield i, first
    if len(streams) == 1:
        if not firsts[0].request_finished:
            async for out in streams[0]:
                yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await q.put((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await q.put((i, exc))
        await q.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams) if not firsts[i].request_finished]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


async def stream_events(
    firsts: list[RequestOutput],
    streams: list[AsyncIterator[RequestOutput]],
    choices: Choices,
    rid: str,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if choices.kind == "chat" else "text_completion"

    def chunk(choice: dict, **extra) -> bytes:
        return sse({"id": rid, "object": obj, "created": int(time.time()), "model": model,
                    "choices": [choice] if choice else [], **extra})

    finals: dict[tuple[int, int], RequestOutput] = {}
    failed: Exception | None = None
    merged = merge(firsts, streams)
    try:
        if choices.kind == "chat":
            for i in range(len(firsts) * choices.n):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        try:
            async for i, out in merged:
                finals[i, out.index] = out
                yield chunk(choices.delta(i, out))
        except RuntimeError as exc:  # AllocatorError too: the request failed, the stream did not
            failed = exc
    finally:
        # Closing the streams before they finished aborts the request, which
        # frees its sequences at the next engine step.
        await merged.aclose()
        for stream in streams:
            await stream.aclose()
    if failed is not None:
        yield sse(failure(failed)[1])
        yield b"data: [DONE]\n\n"
        return
    if include_usage:
        yield chunk({}, usage=usage(list(finals.values())))
    yield b"data: [DONE]\n\n"
