"""The decoder's configuration, read from a Hugging Face `config.json` or GGUF metadata.

One frozen dataclass covers the Llama family this worker runs (Llama 2/3,
Mistral, Qwen2, SmolLM): pre-norm RMSNorm blocks, rotary positions, grouped
query attention and a SwiGLU MLP. What differs between them is data here
(biases, rope scaling, tied embeddings), not code.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ModelConfig", "RopeScaling", "UnsupportedModelError"]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this decoder does not implement."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary frequency scaling. `kind` is "linear" or "llama3".

    linear: every inverse frequency divided by `factor` (position interpolation).
    llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend
    between, as Llama 3.1 defines it with `low_freq_factor`, `high_freq_factor`
    and `original_max_position_embeddings`.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise UnsupportedModelError(
                f"rope scaling type {self.kind!r} is not supported (supported: linear, llama3)"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> RopeScaling | None:
        """From HF's `rope_scaling` / `rope_parameters` dict; None for plain RoPE."""
        if not d:
            return None
        kind = d.get("rope_type", d.get("type"))
        if kind in (None, "default"):
            return None
        if kind == "linear":
            return cls("linear", float(d["factor"]))
        if kind == "llama3":
            return cls(
                "llama3",
                float(d["factor"]),
                float(d.get("low_freq_factor", 1.0)),
                float(d.get("high_freq_factor", 4.0)),
                int(d.get("original_max_position_embeddings", 8192)),
            )
        raise UnsupportedModelError(
            f"rope scaling type {kind!r} is not supported (supported: linear, llama3)"
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder.

    Invariants: heads divide evenly into kv heads (GQA), head_dim is even (RoPE
    rotates pairs), every size is positive.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # The attention window if the checkpoint uses one. Not implemented: the
    # loader caps `max_model_len` at it, so results within that length are exact.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a "
                f"multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): the model-identity part of the fingerprint."""
        return json.dumps(asdict(self), sort_keys=True, default=str)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face `config.json` dict (transformers 4.x or 5.x spelling)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
        # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x used
        # top-level `rope_theta` and `rope_scaling`.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=RopeScaling.from_dict(rope),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama's
            # `attention_bias` covers all four projections.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=_sliding_window(d),
        )


def _sliding_window(d: dict[str, Any]) -> int | None:
    window = d.get("sliding_window")
    if window is None:
        return None
    if d.get("model_type") == "qwen2" and not d.get("use_sliding_window", False):
        return None
    return int(window)
