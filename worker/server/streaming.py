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
from collections.abc import AsyncIterator

from pagedkv_base.tokenizer import Tokenizer, TokenTexts
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
    """How one request's outputs become choices (whole, or streamed deltas).

    A choice's text is the engine's (decode(prompt + output) minus
    decode(prompt)); echoed, the prompt's decode comes first. Logprobs spell
    each token as it reads in that text (`TokenTexts`), so `tokens` concatenate
    to the text (a special token the text skips is spelled and adds nothing)
    and `text_offset` points into it."""

    def __init__(
        self,
        kind: str,
        n: int,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        echo: list[str] | None = None,
        return_token_ids: bool = False,
    ) -> None:
        self.kind = kind  # "chat" or "text"
        self.return_token_ids = return_token_ids
        self.n = n
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.echo = echo  # per prompt: its text, shown before the completion
        self._offsets: dict[int, int] = {}  # streamed text per choice so far (text_offset)
        self._texts: dict[int, TokenTexts] = {}  # per streamed choice: its tokens' texts so far

    def index(self, prompt_index: int, out: RequestOutput) -> int:
        return prompt_index * self.n + out.index

    def _spell(
        self, texts: TokenTexts, entries: list, token_ids: list[int], finished: bool
    ) -> tuple[list[dict[int, str]], list[int]]:
        """Per position, the chosen and top tokens' texts there; and how much
        of the text the chosen token adds. Takes the positions from `texts`."""
        spelled, widths = [], []
        for tok, e in zip(token_ids, entries, strict=True):
            d = {} if e is None else {t: texts.alternative(t) for t, _ in e.top}
            d[tok] = texts.next(tok)
            spelled.append(d)
            widths.append(len(d[tok]) if texts.shows(tok) else 0)
        if finished and spelled:  # an incomplete character at the end: shown by the last token
            rest = texts.flush()
            spelled[-1][token_ids[-1]] += rest
            widths[-1] += len(rest)
        return spelled, widths

    def prompt_logprobs(self, out: RequestOutput) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs` field, each prompt token spelled as it reads in the prompt."""
        if out.prompt_logprobs is None:
            return None
        texts = TokenTexts(self.tokenizer, (), self.skip)
        spelled, _ = self._spell(
            texts, out.prompt_logprobs, out.prompt_token_ids[: len(out.prompt_logprobs)], False
        )
        return prompt_logprobs_json(out.prompt_logprobs, spelled)

    def whole(self, prompt_index: int, out: RequestOutput) -> dict:
        index = self.index(prompt_index, out)
        logprobs = None
        if self.kind == "chat":
            if out.logprobs is not None:
                texts = TokenTexts(self.tokenizer, out.prompt_token_ids, self.skip)
                spelled, _ = self._spell(
                    texts, out.logprobs, out.token_ids[: len(out.logprobs)], out.finished
                )
                logprobs = chat_logprobs(out.logprobs, spelled)
            choice = {"index": index, "message": {"role": "assistant", "content": out.text}}
        else:
            text = out.text
            if self.echo is not None:
                text = self.echo[prompt_index] + text
            if out.logprobs is not None:
                texts, entries, ids = self._echoed(
                    out, out.logprobs, out.token_ids[: len(out.logprobs)]
                )
                logprobs = completion_logprobs(
                    entries, ids, *self._spell(texts, entries, ids, out.finished)
                )
            choice = {"index": index, "text": text, "prompt_logprobs": self.prompt_logprobs(out)}
        if self.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
            if self.kind != "chat":
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return {
            **choice,
            "logprobs": logprobs,
            "finish_reason": finish_reason(out),
            "stop_reason": out.stop_reason,
        }

    def _echoed(
        self, out: RequestOutput, entries: list, token_ids: list[int]
    ) -> tuple[TokenTexts, list, list[int]]:
        """With echo, the prompt's logprobs and tokens before the completion's
        (its first token's logprob None), as vLLM answers echo with logprobs;
        and the `TokenTexts` to spell them from their first position."""
        if self.echo is None or out.prompt_logprobs is None:
            return TokenTexts(self.tokenizer, out.prompt_token_ids, self.skip), entries, token_ids
        return (
            TokenTexts(self.tokenizer, (), self.skip),
            [*out.prompt_logprobs, *entries],
            [*out.prompt_token_ids, *token_ids],
        )

    def delta(self, prompt_index: int, out: RequestOutput) -> dict:
        index = self.index(prompt_index, out)
        reason = finish_reason(out) if out.finished else None
        stop_reason = out.stop_reason if out.finished else None
        new = out.new_logprobs
        logprobs = None
        if self.kind == "chat":
            if new is not None:
                texts = self._texts.setdefault(
                    index, TokenTexts(self.tokenizer, out.prompt_token_ids, self.skip)
                )
                spelled, _ = self._spell(texts, new, out.new_token_ids, out.finished)
                logprobs = chat_logprobs(new, spelled)
            return {
                "index": index,
                "delta": {"content": out.new_text} if out.new_text else {},
                "logprobs": logprobs,
                "finish_reason": reason,
                "stop_reason": stop_reason,
                **self._ids(out, first=False),
            }
        text = out.new_text
        first = index not in self._offsets
        if first and self.echo is not None:
            text = self.echo[prompt_index] + text
        offset = self._offsets.get(index, 0)
        if new is not None:
            if first:
                texts, entries, ids = self._echoed(out, new, out.new_token_ids)
                self._texts[index] = texts
            else:
                texts, entries, ids = self._texts[index], new, out.new_token_ids
            spelled, widths = self._spell(texts, entries, ids, out.finished)
            logprobs = completion_logprobs(entries, ids, spelled, widths, offset)
            offset += sum(widths)
        self._offsets[index] = offset
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": stop_reason,
            **self._ids(out, first),
        }

    def _ids(self, out: RequestOutput, first: bool) -> dict:
        """`return_token_ids` of a streamed chunk: its new ids
        (and a completion's prompt ids, first)."""
        if not self.return_token_ids:
            return {}
        ids: dict = {"token_ids": list(out.new_token_ids)}
        if first:
            ids["prompt_token_ids"] = list(out.prompt_token_ids)
        return ids


async def merge(
    firsts: list[RequestOutput], streams: list[AsyncIterator[RequestOutput]]
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

    tasks = [
        asyncio.ensure_future(pump(i, s))
        for i, s in enumerate(streams)
        if not firsts[i].request_finished
    ]
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
        return sse(
            {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": model,
                "choices": [choice] if choice else [],
                **extra,
            }
        )

    finals: dict[tuple[int, int], RequestOutput] = {}
    failed: Exception | None = None
    merged = merge(firsts, streams)
    try:
        if choices.kind == "chat":
            for i in range(len(firsts) * choices.n):
                yield chunk(
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
        try:
            async for i, out in merged:
                finals[i, out.index] = out
                yield chunk(choices.delta(i, out))
        except RuntimeError as exc:  # AllocatorFault too: the request failed, the stream did not
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
