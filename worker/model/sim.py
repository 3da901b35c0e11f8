"""`load_sim_model(spec, dtype)`: a model for a simulated device, from its config.json alone.

No weights are read (none need be there): the roofline's shape
(`worker.sim.ModelShape`) stands in for the model's config, the tokenizer is
the folder's own when it has one, else none (prompts as token ids). The
fingerprint covers the config and the tokenizer's files, so two simulated
workers of one config share cached prefixes, and never with a real model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pagedkv_base.model_files import ModelLoadError, hf_tokenizer, read_json, resolve_model
from pagedkv_base.tokenizer import NoTokenizer
from worker.model.loaded import LoadedModel
from worker.sim import ModelShape

__all__ = ["load_sim_model"]

_FINGERPRINT_VERSION = "pagedkv-sim-model-v1"


def load_sim_model(spec: str | Path, dtype: str | None = None) -> LoadedModel:
    """`spec`: a folder with a config.json (Llama family or OPT). `dtype`: a torch
    name, or None / "auto" for the config's own (float32 ones as bfloat16)."""
    kind, path, name = resolve_model(spec)
    if kind != "hf" or path is None or not (path / "config.json").is_file():
        raise ModelLoadError(
            f"a simulated device needs a model folder holding a config.json, got {str(spec)!r}"
        )
    raw = read_json(path / "config.json")
    shape = ModelShape.from_config(raw, None if dtype in (None, "auto") else dtype)
    h = hashlib.sha256(_FINGERPRINT_VERSION.encode())
    h.update((path / "config.json").read_bytes())
    if (path / "tokenizer.json").is_file():
        tokenizer, template = hf_tokenizer(path)
        h.update((path / "tokenizer.json").read_bytes())
    else:
        tokenizer, template = NoTokenizer(), None
    eos = list(shape.eos_token_ids)
    gen = (
        read_json(path / "generation_config.json")
        if (path / "generation_config.json").is_file()
        else {}
    )
    extra = gen.get("eos_token_id")
    eos += extra if isinstance(extra, list) else [extra] if extra is not None else []
    return LoadedModel(
        model=None,
        config=shape,
        tokenizer=tokenizer,
        fingerprint=h.hexdigest(),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        max_model_len=shape.max_position_embeddings,
        chat_template=template,
        name=name or path.name,
    )
