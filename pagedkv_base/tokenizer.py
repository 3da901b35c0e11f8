"""Text <-> token ids, chat templates and streaming detokenisation.

Wraps a `tokenizers.Tokenizer` (the Rust library, no transformers at run time)
and renders chat templates with a sandboxed Jinja2 environment the way Hugging
Face templates expect (trim_blocks, lstrip_blocks, `raise_exception`,
`tojson`, `strftime_now`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import tokenizers

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "NoTokenizer", "TokenTexts", "Tokenizer"]

_LONG = 4096  # characters (or ids) from which the GIL is let go while tokenizing


class ChatTemplateError(ValueError):
    """The chat template is missing, or refused the messages (`raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and ': chat templates want plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """A model's tokenizer plus its chat template and special tokens.

    `encode(text)` applies the tokenizer's own post-processing (e.g. a BOS token);
    `encode_chat(messages)` renders the template, which already spells every
    special token, and encodes it without adding any.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.backend = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @cached_property
    def _max_token_chars(self) -> int | None:
        """The most characters of a text one token can stand for, or None when
        this tokenizer's pipeline gives no such bound.

        The bound holds when nothing before the model can shrink the text: no
        normalizer, and pre-tokenizers that only split (none that removes
        characters, as Whitespace does). Then every token covers at most as
        many characters as its vocabulary string is long (byte-level
        vocabularies spell one character per byte, which is never fewer than
        the characters it encodes)."""
        spec = json.loads(self.backend.to_str())
        if spec.get("normalizer") is not None:
            return None
        splitters = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}

        def keeps_text(pre) -> bool:
            if pre is None:
                return True
            if pre.get("type") == "Sequence":
                return all(keeps_text(p) for p in pre.get("pretokenizers", ()))
            return (
                pre.get("type") in splitters and str(pre.get("behavior", "")).lower() != "removed"
            )

        if not keeps_text(spec.get("pre_tokenizer")):
            return None
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(t) for t in vocab), default=0) or None

    def min_tokens(self, text: str) -> int:
        """A lower bound of `len(self.encode(text))` that costs nothing (0 when
        there is none): lets a caller refuse a text that can never fit before
        tokenizing megabytes of it."""
        most = self._max_token_chars
        return -(-len(text) // most) if most else 0

    # A long text goes through the batch calls, the ones that let go of the GIL
    # while the Rust code runs (`encode` and `decode` hold it: 8 s for 3 MB, in
    # which no other thread of the process, the event loop included, runs).
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _LONG:
            return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[
                0
            ]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------

    @cached_property
    def _template(self):
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # Sandboxed: a template comes with the checkpoint and is untrusted code.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        Extra keyword arguments (tools=..., documents=...) reach the template.
        """
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        context.update(kwargs)
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **context,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Prompt ids for `messages`: the rendered template, no extra special tokens."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens: the ones `decode(skip_special_tokens=True)` leaves out."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A streaming decoder for one sequence, primed with its prompt: the
        generated text reads as it does after the prompt."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class NoTokenizer(Tokenizer):
    """The tokenizer of a model folder that has none (a config.json alone):
    prompts come as token ids, and the text of an answer is empty (its
    tokens are in `choices[].token_ids`), as vLLM's `--skip-tokenizer-init`."""

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]

    @property
    def vocab_size(self) -> int:
        return 0

    def token_to_id(self, token: str) -> int | None:
        return None

    def min_tokens(self, text: str) -> int:
        return 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("this model has no tokenizer: send the prompt as token ids")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset()

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """Every delta is empty (`decode` is): nothing to decode per token."""
        return NoText(self)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas, as the text
    reads after the prompt: the deltas concatenate to decode(prompt + output)
    minus decode(prompt) (vLLM's rule).

    Decoding token by token is wrong in two ways: a multi-byte character may be
    split across tokens (the partial decode ends in U+FFFD), and some decoders
    render a token differently at the start of a string (SentencePiece's
    Metaspace or Strip drops the leading space; WordPiece joins words with a
    space only between two of them). So each step decodes a short window that
    starts a few tokens back, the prompt's last tokens at first, and emits only
    the text past what that window already showed; while the tail is an
    incomplete character, it emits nothing and waits. A prompt that ends in
    the middle of a character (token ids can) shows U+FFFD for it; the
    completion's first delta then starts with the whole character (as vLLM's).

    With `skip_special_tokens`, special tokens never enter the window (as
    `decode` leaves them out, a window of them alone would render the next
    token as at the start of a string).
    """

    CONTEXT = 5  # prompt tokens the first window starts with (vLLM's)

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._hidden = tokenizer.special_ids if skip_special_tokens else frozenset()
        # The prompt's last shown tokens: the first window.
        tail: list[int] = []
        for t in reversed(prompt_ids):
            if t not in self._hidden:
                tail.append(t)
                if len(tail) == self.CONTEXT:
                    break
        self.ids: list[int] = tail[::-1]
        # ids[prefix:read] is context already emitted (its text: `_shown`); ids[read:] is pending.
        self._prefix = 0
        self._read = len(self.ids)
        self._shown = self._decode(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _delta(self, ids: list[int]) -> str | None:
        """The text `ids` (shown tokens) would add now; None while they add
        none or leave an incomplete character. Past the text the window
        already showed, except a U+FFFD of the prompt's that the window now
        renders whole."""
        before = self._shown
        after = self._decode(self.ids[self._prefix :] + ids)
        same = len(os.path.commonprefix((before, after)))
        if same == len(after) or after.endswith("\ufffd"):
            return None
        return after[same:]

    def step(self, new_ids: Iterable[int]) -> str:
        """Add generated ids; return the new text they complete ("" if none yet)."""
        shown = [t for t in new_ids if t not in self._hidden]
        if not shown:
            return ""
        delta = self._delta(shown)
        self.ids.extend(shown)
        if delta is None:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        self._shown = self._decode(self.ids[self._prefix :])
        return delta

    def peek(self, token_id: int) -> str:
        """The text `token_id` would add if it came next ("" for a token the
        text skips, or one that leaves an incomplete character); nothing changes."""
        if token_id in self._hidden:
            return ""
        return self._delta([token_id]) or ""

    def flush(self) -> str:
        """Whatever is still pending at the end of the sequence, even if incomplete."""
        before, after = self._shown, self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        self._shown = ""
        return after[len(os.path.commonprefix((before, after))) :]


class NoText(IncrementalDetokenizer):
    """The detokenizer of a model without a tokenizer: the text is empty."""

    def __init__(self, tokenizer: NoTokenizer) -> None:
        super().__init__(tokenizer)

    def step(self, new_ids: Iterable[int]) -> str:
        return ""

    def peek(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class TokenTexts:
    """Each token's text where it stands in its sequence, for logprobs.

    A token's text is what it adds to the sequence's text (its
    `IncrementalDetokenizer` delta), so a choice's tokens concatenate to its
    text and `text_offset` points into it: a token that leaves a character
    incomplete adds "", the one that completes it adds the whole character.
    A special token the text skips adds nothing and is spelled out. An
    alternative at a position gets the text it would have added there.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._detok = tokenizer.detokenizer(prompt_ids, skip_special_tokens)
        self._hidden = tokenizer.special_ids if skip_special_tokens else frozenset()

    def shows(self, token_id: int) -> bool:
        """Whether the text shows the token (a special one it skips adds nothing)."""
        return token_id not in self._hidden

    def _spelled(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def alternative(self, token_id: int) -> str:
        """The text `token_id` would add next (before `next` takes the position)."""
        return self._spelled(token_id) if token_id in self._hidden else self._detok.peek(token_id)

    def next(self, token_id: int) -> str:
        """The text `token_id` adds, taking the next position."""
        return self._spelled(token_id) if token_id in self._hidden else self._detok.step([token_id])

    def flush(self) -> str:
        """What the last tokens left pending (an incomplete
        character), at the end of the sequence."""
        return self._detok.flush()
