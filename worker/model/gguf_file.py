"""Reading a llama.cpp GGUF file: config, weights and tokenizer, with the `gguf` package.

Weights are dequantised with `gguf.quants.dequantize` to float32 and renamed to
Hugging Face names so `LlamaForCausalLM.load_weights` takes them unchanged.
llama.cpp's converter permutes the rows of Llama's Q and K projections (it
interleaves the two rotary halves of each head, for its own RoPE kernel); we
undo that so the weights fit the half-split RoPE this decoder uses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv_base.model_files import gguf_tokenizer
from pagedkv_base.tokenizer import Tokenizer
from worker.model.config import ModelConfig, RopeScaling, UnsupportedModelError

__all__ = ["GGUFModelFile"]

# GGUF tensor name -> Hugging Face name ({i} is the layer).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _undo_rope_permutation(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation: per head, rows were reordered
    from [half0 | half1] to interleaved pairs (half0[0], half1[0], half0[1], ...)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFModelFile:
    """One `.gguf` file, opened lazily (memory-mapped by GGUFReader)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        self._reader = GGUFReader(self.path)
        self.metadata: dict[str, Any] = {
            name: field.contents()
            for name, field in self._reader.fields.items()
            if not name.startswith("tokenizer.ggml.")  # the big arrays are read on demand
        }
        self.architecture: str = self.metadata["general.architecture"]
        if self.architecture not in ("llama", "qwen2"):
            raise UnsupportedModelError(
                f"GGUF architecture {self.architecture!r} "
                "is not supported (supported: llama, qwen2)"
            )

    def _field(self, name: str, default: Any = None) -> Any:
        field = self._reader.fields.get(name)
        return default if field is None else field.contents()

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    # -- config -----------------------------------------------------------------

    def config(self) -> ModelConfig:
        heads = int(self._arch("attention.head_count"))
        hidden = int(self._arch("embedding_length"))
        scaling = None
        kind = self._arch("rope.scaling.type")
        if kind not in (None, "none"):
            scaling = RopeScaling.from_dict(
                {"type": kind, "factor": self._arch("rope.scaling.factor")}
            )
        names = {t.name for t in self._reader.tensors}
        vocab = self._arch("vocab_size") or len(self._field("tokenizer.ggml.tokens"))
        return ModelConfig(
            # Mistral files say "llama": same network, same permutation.
            architecture=self.architecture,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._arch("feed_forward_length")),
            num_layers=int(self._arch("block_count")),
            num_heads=heads,
            num_kv_heads=int(self._arch("attention.head_count_kv", heads)),
            head_dim=int(
                self._arch("attention.key_length")
                or self._arch("rope.dimension_count")
                or hidden // heads
            ),
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._arch("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(self._arch("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
        )

    # -- weights ----------------------------------------------------------------

    def weights(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every tensor in the file."""
        from gguf.quants import dequantize

        # Only llama-architecture files carry the permutation
        # (qwen2 uses NeoX-style RoPE in llama.cpp).
        permute = self.architecture == "llama"
        for t in self._reader.tensors:
            name = self._hf_name(t.name)
            w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
            if permute and name.endswith("q_proj.weight"):
                w = _undo_rope_permutation(w, config.num_heads)
            elif permute and name.endswith("k_proj.weight"):
                w = _undo_rope_permutation(w, config.num_kv_heads)
            w = np.ascontiguousarray(w, dtype=np.float32)
            # F32 tensors come straight from the read-only memory map: copy those.
            yield name, torch.from_numpy(w if w.flags.writeable else w.copy())

    @staticmethod
    def _hf_name(name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        if name == "rope_freqs.weight":
            raise UnsupportedModelError(
                "this GGUF stores llama3 rope scaling as per-frequency factors "
                "(rope_freqs.weight), which is not supported; "
                "load the model's Hugging Face folder instead"
            )
        m = _LAYER_RE.match(name)
        if m and m.group(2) in _LAYER_NAMES:
            return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        raise UnsupportedModelError(f"GGUF tensor {name!r} has no place in a Llama-family decoder")

    # -- tokenizer --------------------------------------------------------------

    def tokenizer(self) -> tuple[Tokenizer, dict[str, Any]]:
        """The file's tokenizer and what it says of special tokens and the template."""
        return gguf_tokenizer(self._reader)
