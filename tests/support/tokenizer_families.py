"""Tokenizers of the families whose decoders render a token by its context,
built in memory with the `tokenizers` library (trained on a few lines, no
download), and a tiny random-weight Llama checkpoint folder around any of them.

- `byte_level`: GPT-2 style byte-level BPE (ByteLevel pre-tokenizer and decoder);
- `llama`: SentencePiece style as Llama 2, Mistral and TinyLlama ship it: a
  normalizer that prepends "▁" and turns spaces into "▁", byte fallback
  tokens `<0x..>`, and the decoder Replace("▁", " "), ByteFallback, Fuse,
  Strip(" ", 1, 0): the first space of a text is dropped;
- `metaspace`: SentencePiece style with the Metaspace pre-tokenizer and
  decoder (prepend_scheme "first"): the first token's "▁" is not a space;
- `wordpiece`: BERT style (lowercasing normalizer, BertPreTokenizer, the
  WordPiece decoder joining words with spaces, "##" pieces glued; without
  `cleanup`, which rewrites text already shown, " ' " to "'").
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from pagedkv_base.tokenizer import Tokenizer
from worker.model.tiny import TINY_CONFIG, random_weights

CORPUS = [
    "The capital of France is Paris.",
    "Don't panic: it's only a test, isn't it?",
    "héllo wörld, naïve café au lait",
    "你好，世界！ 日本語のテキスト",
    "emoji 🙂 and ☃ snowmen, 🎉 party",
    "  two  spaces and\ttabs\nnew lines",
    "numbers 12345 and 3.14 or 2,718",
    "user: what is the answer? assistant: forty-two.",
] * 10

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def byte_level() -> tokenizers.Tokenizer:
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tk


def _sentencepiece(prepend: str) -> tokenizers.Tokenizer:
    tk = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    if prepend == "normalizer":
        tk.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tk.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tk.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    tk.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=420,
            special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
            show_progress=False,
        ),
    )
    # Only <unk>, <s> and </s> are special; the byte tokens are ordinary pieces.
    tk.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")]
    )
    spec = json.loads(tk.to_str())
    spec["added_tokens"] = [
        t for t in spec["added_tokens"] if t["content"] in ("<unk>", "<s>", "</s>")
    ]
    if prepend == "normalizer":
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        }
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def llama() -> tokenizers.Tokenizer:
    return _sentencepiece("normalizer")


def metaspace() -> tokenizers.Tokenizer:
    return _sentencepiece("metaspace")


def wordpiece() -> tokenizers.Tokenizer:
    tk = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tk.train_from_iterator(
        CORPUS,
        trainers.WordPieceTrainer(
            vocab_size=320,
            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
            show_progress=False,
        ),
    )
    return tk


FAMILIES = {
    "byte_level": byte_level,
    "llama": llama,
    "metaspace": metaspace,
    "wordpiece": wordpiece,
}
EOS = {"byte_level": "<|endoftext|>", "llama": "</s>", "metaspace": "</s>", "wordpiece": "[SEP]"}


def family_tokenizer(name: str) -> Tokenizer:
    return Tokenizer(FAMILIES[name](), chat_template=CHAT_TEMPLATE, eos_token=EOS[name])


def write_checkpoint(folder: Path, name: str) -> Path:
    """A tiny random-weight Llama (tiny-random's shape, the tokenizer's
    vocabulary) with the family's tokenizer, as a Hugging Face folder."""
    from safetensors.torch import save_file

    tk = FAMILIES[name]()
    vocab = tk.get_vocab_size(with_added_tokens=True)
    c = dataclasses.replace(TINY_CONFIG, vocab_size=vocab)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in random_weights(c)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": vocab,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads,
                "head_dim": c.head_dim,
                "rms_norm_eps": c.rms_norm_eps,
                "rope_theta": c.rope_theta,
                "max_position_embeddings": c.max_position_embeddings,
                "tie_word_embeddings": c.tie_word_embeddings,
                "hidden_act": "silu",
                "torch_dtype": "float32",
            }
        )
    )
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": EOS[name]})
    )
    return folder
