"""A completion's text is what vLLM returns: decode(prompt + output) minus
decode(prompt), streamed as deltas that concatenate to it; echoed, the
prompt's text and it make decode(prompt + output); logprobs' tokens are each
token's part of that text. Checked on tokenizers of every family whose
decoder renders a token by its context (tests/support/tokenizer_families.py),
against the rule and against transformers' own decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedkv_base.tokenizer import TokenTexts
from tests.support.tokenizer_families import CORPUS, FAMILIES, family_tokenizer
from worker.engine.output_processor import OutputProcessor
from worker.engine.sampling import SamplingParams
from worker.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

TOKENIZERS = {name: family_tokenizer(name) for name in FAMILIES}
HF = {
    name: transformers.PreTrainedTokenizerFast(tokenizer_object=t.backend)
    for name, t in TOKENIZERS.items()
}


def _rule(name: str, prompt: list[int], output: list[int], skip: bool = True) -> str | None:
    """decode(prompt + output) minus decode(prompt), by transformers; None
    where no streamed text can equal it: where a token re-renders text that
    was whole before it (ByteFallback turns every byte of an invalid UTF-8
    run into U+FFFD, "\\x00" then "\\x00\\x80" is "\\ufffd\\ufffd"), and a prompt
    that ends mid-character (the completion takes that character whole)."""
    hf = HF[name]

    def decode(ids: list[int]) -> str:
        return hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    before, full = decode(prompt), decode(prompt + output)
    if not full.startswith(before):
        return None
    if not all(
        full.startswith(decode(prompt + output[:i]).rstrip("\ufffd")) for i in range(1, len(output))
    ):
        return None
    return full[len(before) :]


def _run(
    name: str, prompt: list[int], output: list[int], **params
) -> tuple[str, list[str], Sequence]:
    """Feed `output` through the output processor as the engine does; the
    final text and the streamed deltas."""
    tok = TOKENIZERS[name]
    p = SamplingParams(max_tokens=len(output), **params)
    seq = Sequence(request_id="r", prompt_token_ids=list(prompt), params=p, max_tokens=len(output))
    proc = OutputProcessor(tok, eos_token_ids=(), max_model_len=10_000)
    deltas = []
    for t in output:
        seq.token_ids.append(t)
        out = proc.process(seq, t)
        deltas.append(out.new_text)
        if out.finished:
            break
    return out.text, deltas, seq


PROMPT, COMPLETION = "The capital of France is", " Paris, of course"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_first_word_keeps_its_space(name):
    """The issue's example: "The capital of France is" + " Paris" is not "Paris"."""
    tok = TOKENIZERS[name]
    prompt = tok.encode(PROMPT)
    output = tok.encode(PROMPT + COMPLETION, add_special_tokens=False)[
        len(tok.encode(PROMPT, add_special_tokens=False)) :
    ]
    text, deltas, _ = _run(name, prompt, output)
    # (lowercased, words spaced)
    expected = " paris , of course" if name == "wordpiece" else COMPLETION
    assert text == "".join(deltas) == expected == _rule(name, prompt, output)


def _ids(name: str):
    return st.integers(0, TOKENIZERS[name].vocab_size - 1)


# Byte-fallback families render a run of byte tokens that is not UTF-8 as one
# U+FFFD per byte, the run's first bytes included: a decode no window can
# reproduce. Their cases come from text (the runs a model writes); the others'
# from any ids too.
BYTE_FALLBACK = {"llama", "metaspace"}
TEXT = st.text(
    st.sampled_from(sorted(set("".join(CORPUS)) | set("éü☃🙂語 \n\t'.,?-"))),
    min_size=2,
    max_size=40,
)


@st.composite
def _case(draw, name: str):
    tok = TOKENIZERS[name]
    if name in BYTE_FALLBACK or draw(st.booleans()):
        ids = tok.encode(draw(TEXT), add_special_tokens=False)
        assume(len(ids) >= 2)
        specials = sorted(tok.special_ids)
        for _ in range(draw(st.integers(0, 2))):  # a special token here and there
            ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from(specials)))
        cut = draw(st.integers(1, len(ids) - 1))
        return ids[:cut], ids[cut:]
    prompt = draw(st.lists(_ids(name), min_size=1, max_size=12))
    output = draw(st.lists(_ids(name), min_size=1, max_size=14))
    return prompt, output


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_text_is_decode_of_prompt_and_output_minus_the_prompts(name, data, skip):
    prompt, output = data.draw(_case(name))
    expected = _rule(name, prompt, output, skip)
    assume(expected is not None)
    text, deltas, _ = _run(name, prompt, output, skip_special_tokens=skip)
    assert "".join(deltas) == text == expected
    # echoed: the prompt's decode, then the completion: the decode of both
    tok = TOKENIZERS[name]
    assert tok.decode(prompt, skip_special_tokens=skip) + text == tok.decode(
        prompt + output, skip_special_tokens=skip
    )


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), include=st.booleans())
def test_stop_strings_cut_the_same_text(name, data, include):
    """A stop string found in the text ends it there (kept with
    `include_stop_str_in_output`); the deltas still concatenate to it."""
    prompt, output = data.draw(_case(name))
    full = _rule(name, prompt, output)
    assume(full and full.strip())
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start : start + data.draw(st.integers(1, 4))]
    assume(stop.strip() and "\ufffd" not in stop)
    text, deltas, seq = _run(name, prompt, output, stop=(stop,), include_stop_str_in_output=include)
    cut = full.index(stop)
    assert text == (full[: cut + len(stop)] if include else full[:cut])
    assert "".join(deltas) == text and seq.stop_reason == stop


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_logprob_tokens_are_the_texts_parts(name, data, skip):
    """Each token's text is its part of the text (a skipped special token is
    spelled and adds nothing); an alternative's is what it would have added,
    so the chosen token's text equals its entry among the alternatives."""
    prompt, output = data.draw(_case(name))
    text, _, _ = _run(name, prompt, output, skip_special_tokens=skip)
    tok = TOKENIZERS[name]
    texts = TokenTexts(tok, prompt, skip)
    parts = []
    for t in output:
        alternative = texts.alternative(t)
        part = texts.next(t)
        assert part == alternative
        parts.append(part)
    # an incomplete character left at the end is shown by the last token, even a skipped
    # special one (its width, as the server counts text_offset)
    rest = texts.flush()
    hidden = tok.special_ids if skip else frozenset()
    assert "".join(p for p, t in zip(parts, output, strict=True) if t not in hidden) + rest == text
    for p, t in zip(parts, output, strict=True):
        if t in hidden:
            assert p == tok.decode([t], skip_special_tokens=False)


def test_a_prompt_ending_mid_character_completes_it():
    """Token ids can end a prompt in the middle of a character: its decode
    shows U+FFFD there, and the completion starts with the whole character."""
    tok = TOKENIZERS["byte_level"]
    ids = tok.encode("café ☃ done", add_special_tokens=False)
    snowman = [i for i in range(len(ids)) if "☃" in tok.decode(ids[: i + 1])][0]
    assume_split = [k for k in range(1, snowman + 1) if tok.decode(ids[:k]).endswith("\ufffd")]
    if not assume_split:
        pytest.skip("the trained vocabulary holds the snowman in one token")
    k = assume_split[0]
    text, deltas, _ = _run("byte_level", ids[:k], ids[k:])
    assert (
        text.startswith("☃")
        and "".join(deltas) == text == tok.decode(ids)[len(tok.decode(ids[:k]).rstrip("\ufffd")) :]
    )
