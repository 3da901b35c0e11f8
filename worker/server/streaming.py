"""Server-sent events: one chunk per engine output, then `data: [DONE]`.

Chat streams open with the assistant role; with `stream_options.include_usage`
a last chunk carries the usage. Closing the stream early aborts the request.
A request that fails after its first chunk (the allocator gave up, an engine
step failed) ends with an OpenAI-shaped `{"error": ...}` event, then
`[DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from worker.engine import RequestOutput
from worker.server.errors import failure
from worker.server.protocol import finish_reason, usage


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def stream_events(
    first: RequestOutput,
    stream: AsyncIterator[RequestOutput],
    rid: str,
    model: str,
    kind: str,  # "chat" or "text"
    include_usage: bool,
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(choice: dict, **extra) -> bytes:
        return sse({"id": rid, "object": obj, "created": int(time.time()), "model": model,
                    "choices": [choice] if choice else [], **extra})

    def piece(out: RequestOutput) -> dict:
        reason = finish_reason(out) if out.finished else None
        if kind == "chat":
            return {"index": 0, "delta": {"content": out.new_text} if out.new_text else {},
                    "finish_reason": reason, "logprobs": None}
        return {"index": 0, "text": out.new_text, "finish_reason": reason, "logprobs": None}

    last = first
    failed: Exception | None = None
    try:
        if kind == "chat":
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        yield chunk(piece(first))
        if not first.finished:
            try:
                async for out in stream:
                    last = out
                    yield chunk(piece(out))
            except RuntimeError as exc:  # AllocatorError too: the request failed, the stream did not
                failed = exc
    finally:
        # Closing the stream before it finished aborts the request, which
        # frees its sequence at the next engine step.
        await stream.aclose()
    if failed is not None:
        yield sse(failure(failed)[1])
        yield b"data: [DONE]\n\n"
        return
    if include_usage:
        yield chunk({}, usage=usage(last))
    yield b"data: [DONE]\n\n"
