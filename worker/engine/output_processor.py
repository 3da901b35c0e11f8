"""From sampled tokens to what a client sees: `RequestOutput`.

`OutputProcessor.process(seq, token)` decides whether the token ends the
sequence (a stop or eos token, the length limit, a stop string), extends the
sequence's text through its incremental detokenizer, and returns the step's
output: every token and character so far plus this step's delta.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from worker.engine.sequence import Sequence
from worker.model.tokenizer import Tokenizer


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


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int], max_model_len: int) -> None:
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
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.text[: seq.emitted],
            new_token_ids=[tok],
            new_text=new_text,
            finished=reason is not None,
            finish_reason=reason,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
        )

    def failed(self, seq: Sequence) -> RequestOutput:
        """The last output of a sequence that ended in `seq.error`."""
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), text=seq.text[: seq.emitted], finished=True, finish_reason="error",
            num_cached_tokens=seq.num_cached_tokens, num_preemptions=seq.num_preemptions, error=seq.error,
        )

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _advance_text(self, seq: Sequence, tok: int, reason: str | None) -> str:
        """Extend the sequence's text by `tok` and return what may be streamed now.

        The stop/eos token itself is never shown. With stop strings, the last
        (longest stop string - 1) characters are held back until the next
        token shows they do not start a stop string: streamed text is never
        taken back."""
        if seq.detokenizer is None:
            seq.detokenizer = self.tokenizer.detokenizer()
        if reason != "stop":
            seq.text += seq.detokenizer.step([tok])
        if reason is not None:
            seq.text += seq.detokenizer.flush()
        stops = seq.params.stop
        hold = 0
        if stops:
            longest = max(map(len, stops))
            start = max(0, seq.checked - longest + 1)
            cut = min((i for i in (seq.text.find(x, start) for x in stops) if i >= 0), default=-1)
            if cut >= 0:
                seq.text = seq.text[:cut]
                seq.stopped_by_string = True
            elif reason is None:
                hold = longest - 1
            seq.checked = len(seq.text)
        end = max(seq.emitted, len(seq.text) - hold)
        new_text = seq.text[seq.emitted : end]
        seq.emitted = end
        return new_text
