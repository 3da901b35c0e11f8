"""From sampled tokens to what a client sees: `RequestOutput`.

`OutputProcessor.process(seq, token)` decides whether the token ends the
sequence (a stop or eos token, the length limit, a stop string), extends its
text through its incremental detokenizer (primed with the prompt's last
tokens, so the text is decode(prompt + output) minus decode(prompt)), and
returns every token and character so far plus this step's delta. vLLM's
rules: nothing stops a sequence before `min_tokens`; the stop token and stop
string are cut from the text unless `include_stop_str_in_output`;
`stop_reason` is the stop string or stop token id (None for eos or length).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedkv_base.tokenizer import Tokenizer
from worker.engine.sampling import Logprobs
from worker.engine.sequence import Sequence


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str  # every generated character so far (stop strings cut off)
    new_token_ids: list[int] = field(default_factory=list)  # this step's delta
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None
    stop_reason: str | int | None = None
    # every generated token's, when asked for (on the last output)
    logprobs: list[Logprobs] | None = None
    new_logprobs: list[Logprobs] | None = None  # this step's delta, when asked for
    prompt_logprobs: list[Logprobs | None] | None = None
    index: int = 0  # which sample of the request (n > 1)
    request_finished: bool = False  # every sample of the request has finished (set by the engine)


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, eos_token_ids: Iterable[int], max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def process(self, seq: Sequence, tok: int) -> RequestOutput:
        """The output for `tok`, just appended to `seq.token_ids`."""
        reason = self._finish_reason(seq, tok)
        new_text = self._advance_text(seq, tok, reason)
        if seq.stopped_by_string:
            reason = "stop"
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,  # (a new list)
            text=seq.text[: seq.emitted],
            new_token_ids=[tok],
            new_text=new_text,
            finished=reason is not None,
            finish_reason=reason,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs)
            if seq.logprobs is not None and reason is not None
            else None,
            new_logprobs=seq.logprobs[-1:] if seq.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,
        )

    def failed(self, seq: Sequence) -> RequestOutput:
        """The last output of a sequence that ended in `seq.error`."""
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.text[: seq.emitted],
            finished=True,
            finish_reason="error",
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            error=seq.error,
        )

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        tokens = len(seq.token_ids)
        generated = tokens - len(seq.prompt_token_ids)
        if generated >= p.min_tokens:
            if tok in p.stop_token_ids:
                seq.stop_reason = tok
                return "stop"
            if not p.ignore_eos and tok in self.eos_token_ids:
                return "stop"
        if generated >= seq.max_tokens or tokens >= self.max_model_len:
            return "length"
        return None

    def _advance_text(self, seq: Sequence, tok: int, reason: str | None) -> str:
        """Extend the sequence's text by `tok` and return what may be streamed now.

        The stop/eos token itself is never shown. With stop strings, the last
        (longest stop string - 1) characters are held back until the next
        token shows they do not start a stop string: streamed text is never
        taken back."""
        p = seq.params
        if seq.detokenizer is None:
            # Primed with the prompt, so the text reads as it does after it
            # (vLLM's rule: decode(prompt + output) minus decode(prompt)).
            seq.detokenizer = self.tokenizer.detokenizer(
                seq.prompt_token_ids, p.skip_special_tokens
            )
        if reason != "stop" or p.include_stop_str_in_output:
            seq.text += seq.detokenizer.step([tok])
        if reason is not None:
            seq.text += seq.detokenizer.flush()
        stops = p.stop if seq.num_output_tokens >= p.min_tokens else ()
        hold = 0
        if stops:
            longest = max(map(len, stops))
            start = max(0, seq.checked - longest + 1)
            found = [(i, x) for x in stops if (i := seq.text.find(x, start)) >= 0]
            if found:
                cut, stop = min(found, key=lambda f: f[0])
                seq.text = (
                    seq.text[: cut + len(stop)] if p.include_stop_str_in_output else seq.text[:cut]
                )
                seq.stopped_by_string = True
                seq.stop_reason = stop
            elif reason is None:
                hold = longest - 1
            seq.checked = len(seq.text)
        end = max(seq.emitted, len(seq.text) - hold)
        new_text = seq.text[seq.emitted : end]
        seq.emitted = end
        return new_text
