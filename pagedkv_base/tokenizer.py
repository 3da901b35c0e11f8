"""Text <-> token ids, chat templates and streaming detokenisation.

Wraps a `tokenizers.Tokenizer` (the Rust library, no transformers at run time)
and renders chat templates with a sandboxed Jinja2 environment the way Hugging
Face templates expect (trim_blocks, lstrip_blocks, `raise_exception`,
`tojson`, `strftime_now`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import tokenizers

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]


class ChatTemplateError(ValueError):
    """The chat template is missing, or refused the messages (`raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and ': chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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
            return pre.get("type") in splitters and str(pre.get("behavior", "")).lower() != "removed"

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------

    @cached_property
    def _template(self):
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # Sandboxed: a template comes with the checkpoint and is untrusted code.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
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
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **context
        )

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Prompt ids for `messages`: the rendered template, no extra special tokens."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(self, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A streaming decoder for one sequence (optionally primed with its prompt)."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas.

    Decoding token by token is wrong in two ways: a multi-byte character may be
    split across tokens (the partial decode ends in U+FFFD), and some decoders
    render a token differently at the start of a string (SentencePiece drops
    the leading space). So each step decodes a short window that starts a few
    tokens back and emits only the text past what that window already showed;
    while the tail is an incomplete character, it emits nothing and waits.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        # ids[prefix:read] is context already emitted; ids[read:] is pending.
        self._prefix = max(0, len(self.ids) - 5)
        self._read = len(self.ids)

    def step(self, new_ids: Iterable[int]) -> str:
        """Add generated ids; return the new text they complete ("" if none yet)."""
        self.ids.extend(new_ids)
        def decode(ids: list[int]) -> str:
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

        before = decode(self.ids[self._prefix : self._read])
        after = decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still pending at the end of the sequence, even if incomplete."""
        def decode(ids: list[int]) -> str:
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

        before = decode(self.ids[self._prefix : self._read])
        after = decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]
