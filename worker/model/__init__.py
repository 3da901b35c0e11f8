"""The Llama-family decoder, its configuration, tokenizer and loaders.

Entry point: `load_model(spec, device, dtype) -> LoadedModel` (see `loader`).
"""

from __future__ import annotations

from pagedkv_base.model_files import ModelLoadError
from pagedkv_base.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from worker.model.config import ModelConfig, RopeScaling, UnsupportedModelError
from worker.model.llama import LlamaForCausalLM
from worker.model.loaded import LoadedModel
from worker.model.loader import load_model

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "Tokenizer",
    "UnsupportedModelError",
    "load_model",
]
