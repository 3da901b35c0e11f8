"""The pieces whole and streamed answers share, in OpenAI's shapes: usage,
finish reason, logprobs (completions, chat and vLLM's `prompt_logprobs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine import RequestOutput
    from worker.engine.sampling import Logprobs


def usage(outs: list[RequestOutput]) -> dict:
    """Usage of a request's final outputs: every prompt once, every sample's tokens."""
    seen: dict[str, RequestOutput] = {}
    for out in outs:
        seen.setdefault(out.request_id, out)
    p = sum(len(o.prompt_token_ids) for o in seen.values())
    c = sum(len(o.token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in seen.values())
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish_reason(out: RequestOutput) -> str | None:
    """The engine's reason in OpenAI's words: an aborted request just stopped."""
    if out.finish_reason in ("abort", "error"):
        return "stop" if out.finish_reason == "abort" else "error"
    return out.finish_reason


def completion_logprobs(
    entries: list[Logprobs | None],
    token_ids: list[int],
    texts: list[dict[int, str]],
    widths: list[int],
    offset: int = 0,
) -> dict:
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
    return {
        "text_offset": offsets,
        "token_logprobs": token_lps,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def prompt_logprobs_json(
    entries: list[Logprobs | None] | None, texts: list[dict[int, str]] | None
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

    return {
        "content": [
            {
                **item(e.token_id, e.logprob, spelled),
                "top_logprobs": [item(t, v, spelled) for t, v in e.top],
            }
            for e, spelled in zip(entries, texts, strict=True)
        ]
    }
