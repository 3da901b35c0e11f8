"""vLLM's text rule through the real worker process and the official
`openai` client, on a tiny random-weight Llama served with a tokenizer of
each family whose decoder renders a token by its context
(tests/support/tokenizer_families.py): every choice's text is
decode(prompt + output) minus decode(prompt) (completions and chat, whole and
streamed, n > 1, stop strings with and without `include_stop_str_in_output`);
echoed, decode(prompt + output); logprobs' `tokens` and `text_offset` point
into that text. The generated ids come from the offline engine on the same
checkpoint (greedy, or seeded), the expected texts from transformers' decode."""

from __future__ import annotations

import openai
import pytest

from tests.support.tokenizer_families import FAMILIES, write_checkpoint
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.model.loader import load_model

transformers = pytest.importorskip("transformers")

PROMPT = "The capital of France is"
MODEL = "family"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, worker_process):
    """(name, openai client, offline engine, transformers tokenizer, extra body) per family."""
    name = request.param
    folder = write_checkpoint(tmp_path_factory.mktemp(name), name)
    engine = LLMEngine(load_model(folder), EngineConfig(num_blocks=128, block_size=4))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    # Byte-fallback tokens are kept out: random weights write byte runs that
    # are not UTF-8, which ByteFallback renders differently once a later byte
    # arrives (test_detokenize.py's note); words are what this is about.
    tok = engine.tokenizer
    bias = {
        str(i): -100
        for i in range(tok.vocab_size)
        if (tok.backend.id_to_token(i) or "").startswith("<0x")
    }
    with worker_process(
        "--model",
        str(folder),
        "--served-model-name",
        MODEL,
        "--num-blocks",
        "128",
        "--block-size",
        "4",
        "--max-model-len",
        "256",
        "--threads",
        "1",
    ) as url:
        yield (
            name,
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0),
            engine,
            hf,
            bias,
        )


def _decode(hf, ids: list[int]) -> str:
    return hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _rule(hf, prompt: list[int], output: list[int]) -> str:
    before, full = _decode(hf, prompt), _decode(hf, prompt + output)
    assert full.startswith(before)
    return full[len(before) :]


def _offline(engine, prompt: list[int], bias: dict, **kw) -> list[list[int]]:
    params = SamplingParams(
        ignore_eos=True, logit_bias=tuple((int(k), float(v)) for k, v in bias.items()), **kw
    )
    return [o.token_ids for o in engine.generate_samples([prompt], params)[0]]


def _pieces_agree(text: str, tokens: list[str], offsets: list[int], shown: list[bool]) -> None:
    """Each shown token is the text at its offset; the shown tokens make the text."""
    for tok, at, show in zip(tokens, offsets, shown, strict=True):
        if show:
            assert text[at : at + len(tok)] == tok
    assert "".join(t for t, s in zip(tokens, shown, strict=True) if s) == text


def test_completion_text_echo_and_logprobs(family):
    name, client, engine, hf, bias = family
    tok = engine.tokenizer
    for prompt in (PROMPT, tok.encode(PROMPT, add_special_tokens=False)[-3:]):
        prompt_ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        [ids] = _offline(engine, prompt_ids, bias, max_tokens=10, temperature=0)
        expected = _rule(hf, prompt_ids, ids)
        kw = dict(
            model=MODEL,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            logprobs=2,
            extra_body={"ignore_eos": True},
            logit_bias=bias,
        )
        whole = client.completions.create(**kw).choices[0]
        assert whole.text == expected
        shown = [t not in tok.special_ids for t in ids]
        _pieces_agree(whole.text, whole.logprobs.tokens, whole.logprobs.text_offset, shown)
        for i, t in enumerate(whole.logprobs.tokens):
            # the chosen token among the top ones, spelled alike
            # (the likeliest of the tokens sharing its
            # spelling; logprobs are taken before logit_bias)
            assert whole.logprobs.top_logprobs[i][t] >= whole.logprobs.token_logprobs[i]
        text, tokens, offsets = "", [], []
        for chunk in client.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                text += ch.text
                tokens += ch.logprobs.tokens
                offsets += ch.logprobs.text_offset
        assert (
            text == expected
            and tokens == whole.logprobs.tokens
            and offsets == whole.logprobs.text_offset
        )
        # echoed: the prompt's decode, then the completion: the decode of both
        echo = client.completions.create(echo=True, **kw).choices[0]
        assert echo.text == _decode(hf, prompt_ids + ids)
        shown = [t not in tok.special_ids for t in prompt_ids + ids]
        _pieces_agree(echo.text, echo.logprobs.tokens, echo.logprobs.text_offset, shown)


def test_chat_text_and_logprobs(family):
    name, client, engine, hf, bias = family
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = engine.tokenizer.encode_chat(msgs)
    [ids] = _offline(engine, prompt_ids, bias, max_tokens=10, temperature=0)
    expected = _rule(hf, prompt_ids, ids)
    kw = dict(
        model=MODEL,
        messages=msgs,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
        logit_bias=bias,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.message.content == expected
    shown = [t not in engine.tokenizer.special_ids for t in ids]
    tokens = [c.token for c in whole.logprobs.content]
    assert "".join(t for t, s in zip(tokens, shown, strict=True) if s) == expected
    text, streamed = "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            streamed += [c.token for c in (ch.logprobs.content if ch.logprobs else [])]
    assert text == expected and streamed == tokens


@pytest.mark.parametrize("include", [False, True])
def test_samples_and_stop_strings(family, include):
    """n = 2 seeded samples, each cut at a stop string found in sample 0's text."""
    name, client, engine, hf, bias = family
    prompt_ids = engine.tokenizer.encode(PROMPT)
    samples = _offline(engine, prompt_ids, bias, max_tokens=12, temperature=1.0, seed=11, n=2)
    full = [_rule(hf, prompt_ids, ids) for ids in samples]
    words = full[0].split()
    stop = words[min(2, len(words) - 1)][:3]
    kw = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        seed=11,
        n=2,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": include},
        logit_bias=bias,
    )

    def cut(text: str) -> str:
        at = text.find(stop)
        return text if at < 0 else text[: at + len(stop)] if include else text[:at]

    whole = client.completions.create(**kw)
    assert [c.text for c in whole.choices] == [cut(t) for t in full]
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert streamed == {0: cut(full[0]), 1: cut(full[1])}
