"""`LoadedModel`: what the engine needs about one loaded model.

Built by the loaders (`loader` for files, `tiny` for the in-memory test
model); its own module so that neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedkv_base.tokenizer import Tokenizer
from worker.model.config import ModelConfig
from worker.model.llama import LlamaForCausalLM
from worker.sim import ModelShape

__all__ = ["LoadedModel"]


@dataclass(frozen=True, slots=True, eq=False)
class LoadedModel:
    """Everything the engine needs about one model.

    `fingerprint` is stable across processes and restarts for the same files
    (SHA-256 over the config and the weight files' names and sizes): it keys
    the prefix cache, so two workers share cached blocks only if it matches.

    On a simulated device (`--device sim:NAME`) there is no `model` (None)
    and `config` is the roofline's `ModelShape` (worker/model/sim.py).

    `sampling_defaults`: the sampling parameters the model's
    `generation_config.json` sets (temperature, top_p, top_k, min_p,
    repetition_penalty), used when a request leaves them out (vLLM's
    `--generation-config auto`); empty when there is none (GGUF, tiny-random).
    """

    model: LlamaForCausalLM | None
    config: ModelConfig | ModelShape
    tokenizer: Tokenizer
    fingerprint: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    chat_template: str | None
    name: str
    sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if len(self.fingerprint) != 64:
            raise ValueError("fingerprint must be a SHA-256 hex digest")
