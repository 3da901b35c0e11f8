"""A model as the roofline sees it: sizes read from config.json, no weights.

Llama-family configs (`llama`, `mistral`, `qwen2`: grouped-query attention,
a SwiGLU MLP of three matrices) and OPT configs (`opt`: multi-head attention
with biases, a two-matrix MLP, learned positions). The parameter count gives
the weights' bytes (and with them the simulated memory they take) and the
FLOPs of a token; the attention and K/V sizes give the per-context costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.kv_bytes import (
    DTYPE_BYTES,
    canonical_dtype,
    kv_bytes_per_token,
    kv_dims_from_config,
    positive_field,
)

__all__ = ["ARCHITECTURES", "ModelShape", "SimConfigError"]

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
ARCHITECTURES = (*LLAMA_FAMILY, "opt")


class SimConfigError(ValueError):
    """A config.json the simulator cannot time (an unknown architecture, a missing field)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_params: int  # the parameters of one decoder layer
    embedding_params: (
        int  # input embeddings (and OPT's learned positions): looked up, not multiplied
    )
    head_params: int  # the LM head's matrix (tied or not): multiplied only for the rows sampled
    other_params: int  # final norm, an untied head's own copy, OPT's projections
    dtype: str  # weights and K/V element type (torch name)
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    kv_dtype: str | None = None  # the K/V element type when not `dtype` (an fp8 KV cache)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.other_params

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_element(self) -> str:
        """The K/V element type (torch name)."""
        return self.kv_dtype or self.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, DTYPE_BYTES[self.kv_element]
        )

    @classmethod
    def from_config(cls, cfg: dict, dtype: str | None = None) -> ModelShape:
        """From a config.json dict; `dtype` (a torch name) overrides its `torch_dtype`
        (a float32 model is timed in bfloat16, as CUDA serves it)."""
        kind = cfg.get("model_type")
        if kind not in ARCHITECTURES:
            raise SimConfigError(
                f"config.json: model_type {kind!r} cannot be simulated "
                f"(known: {', '.join(ARCHITECTURES)})"
            )
        try:
            layers, kv_heads, head_dim = kv_dims_from_config(cfg)
            vocab, hidden = positive_field(cfg, "vocab_size"), positive_field(cfg, "hidden_size")
            heads = positive_field(cfg, "num_attention_heads")
            inter = positive_field(cfg, "ffn_dim" if kind == "opt" else "intermediate_size")
            max_pos = positive_field(cfg, "max_position_embeddings")
        except ValueError as exc:
            raise SimConfigError(f"{exc}: the roofline needs it") from None
        q, kv = heads * head_dim, kv_heads * head_dim
        if kind == "opt":
            proj = cfg.get("word_embed_proj_dim") or hidden
            # q, k, v, out with biases; two layer norms (weight + bias); fc1 and fc2 with biases
            layer = (
                4 * (hidden * hidden + hidden) + 2 * inter * hidden + inter + hidden + 4 * hidden
            )
            embedding = vocab * proj + (max_pos + 2) * hidden  # OPT's positions start at offset 2
            # final norm; projections
            other = 2 * hidden + (2 * proj * hidden if proj != hidden else 0)
            head = vocab * proj  # tied to the input embeddings
        else:
            bias = q + 2 * kv if kind == "qwen2" or cfg.get("attention_bias") else 0
            layer = hidden * (q + 2 * kv) + bias + q * hidden + 3 * hidden * inter + 2 * hidden
            embedding = vocab * hidden
            head = vocab * hidden
            other = hidden + (0 if cfg.get("tie_word_embeddings") else head)
        name = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        name = canonical_dtype(name.removeprefix("torch.")) or name
        if name == "float32" and dtype is None:
            name = "bfloat16"
        if name not in ("float16", "bfloat16", "float32"):
            raise SimConfigError(
                f"config.json: dtype {name!r} cannot be simulated (float16, bfloat16, float32)"
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(
            int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])
        )
        return cls(
            kind,
            vocab,
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            layer,
            embedding,
            head,
            other,
            name,
            max_pos,
            eos_ids,
        )
