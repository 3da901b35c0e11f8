"""The Llama-family decoder, its configuration, tokenizer and loaders.

Entry point: `load_model(spec, device, dtype) -> LoadedModel` (see `loader`).
"""

from __future__ import annotations

from worker.model.config import ModelConfig, RopeScaling, UnsupportedModelError
from worker.model.llama import LlamaForCausalLM
from worker.model.loaded import LoadedModel
from worker.model.loader import ModelLoadError, load_model
from worker.model.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

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
