"""A Llama-family decoder whose attention reads and writes the paged KV pool.

One forward pass serves one scheduler step: `T` new tokens from any mix of
prefilling and decoding sequences, concatenated as `AttentionMetadata`
describes. Per layer the new K/V are written through `meta.slot_mapping`
BEFORE attention runs, so a query sees its own token, earlier tokens of its
own chunk, and the sequence's cached prefix, all through the block table.

Weights are kept fused (q|k|v in one matrix, gate|up in another) so each
layer runs two matmuls fewer; `load_weights` takes checkpoint tensors under
their Hugging Face names and slices them into place. Inference only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention import AttentionBackend, AttentionMetadata, select_backend
from worker.kv_pool import KVPool
from worker.model.config import ModelConfig, RopeScaling

__all__ = ["LlamaForCausalLM", "rope_inv_freq"]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim / 2], float32 on the CPU (under a device context
    too: on the meta device this arithmetic would import torch._dynamo), with scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the original context / low_freq_factor are
    # stretched by `factor`, shorter than context / high_freq_factor kept, and
    # the band between interpolates linearly in (context / wavelength).
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = context / scaling.low_freq_factor
    high_wavelen = context / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of x [T, heads, D] by angles with cos/sin [T, 1, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in float32 whatever the model dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.split = (config.q_size, config.kv_size, config.kv_size)
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split), bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: KVPool,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = apply_rope(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        # write first: queries read their own K/V
        kv_pool.write(self.layer, meta.slot_mapping, k, v)
        out = backend(
            q,
            kv_pool.k_cache(self.layer),
            kv_pool.v_cache(self.layer),
            meta,
            self.scale,
            kv_pool.k_scale(self.layer),
            kv_pool.v_scale(self.layer),
        )
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class DecoderStack(nn.Module):
    """Embeddings, layers and final norm; named like HF's `model.` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # NOTE: given its weight, nn.Embedding skips its random init: on the meta device that
        # init (normal_) goes through torch._refs, which imports torch._dynamo (seconds).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder. Build with `LlamaForCausalLM.create(config, device, dtype)`, then
    `load_weights`; call `model(input_ids, positions, kv_pool, meta)`.

    `attn_backend` (default: `select_backend(device)`) may be replaced, e.g. by
    `get_backend("reference")` in tests.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer(
            "inv_freq",
            rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling),
            persistent=False,
        )
        self.attn_backend: AttentionBackend = select_backend("cpu")

    @classmethod
    def create(
        cls, config: ModelConfig, device: str | torch.device, dtype: torch.dtype
    ) -> LlamaForCausalLM:
        """An UNINITIALISED model on `device` (no time spent on random init); fill it
        with `load_weights`."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype).to_empty(device=device)
        if config.tie_word_embeddings:  # to_empty made two tensors of the tied one
            model.lm_head.weight = model.model.embed_tokens.weight
        # Buffers are not weights: recompute them (to_empty left garbage), in float32.
        model.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(
            device
        )
        model.attn_backend = select_backend(device)
        prepare = getattr(model.attn_backend, "prepare", None)
        if prepare is not None:  # e.g. the CPU kernel compiled at load, not at the first requests
            prepare(dtype)
        return model.eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]."""
        if kv_pool.block_size != meta.block_size:
            raise ValueError(
                f"pool block size {kv_pool.block_size} != metadata block size {meta.block_size}"
            )
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = freqs.cos().to(self.dtype)[:, None, :]  # [T, 1, D/2]: shared by all heads and layers
        sin = freqs.sin().to(self.dtype)[:, None, :]
        h = self.model.embed_tokens(input_ids)
        backend = self.attn_backend
        for layer in self.model.layers:
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, kv_pool, meta, backend)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (rows the engine selected) -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    # -- weights ------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors, named as in Hugging Face Llama checkpoints
        (`model.layers.0.self_attn.q_proj.weight`, ...), into the fused parameters.

        Raises if a tensor has the wrong shape, a name is unknown, or a parameter
        is left unset (the model is created uninitialised, so that would be garbage).
        """
        params = dict(self.named_parameters())
        c = self.config
        shards = {
            "q_proj": ("qkv_proj", 0, c.q_size),
            "k_proj": ("qkv_proj", c.q_size, c.kv_size),
            "v_proj": ("qkv_proj", c.q_size + c.kv_size, c.kv_size),
            "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
            "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        expected: dict[str, int] = {}  # parameter name -> rows it needs
        for name, p in params.items():
            expected[name] = p.shape[0]
        filled: dict[str, int] = {}
        with torch.no_grad():
            for name, tensor in weights:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer some old checkpoints saved; we compute it
                if name == "lm_head.weight" and c.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                target, start, rows = name, 0, None
                parts = name.rsplit(".", 2)
                if len(parts) == 3 and parts[1] in shards:
                    fused, start, rows = shards[parts[1]]
                    target = f"{parts[0]}.{fused}.{parts[2]}"
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in this model")
                param = params[target]
                dest = param if rows is None else param[start : start + rows]
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} "
                        f"!= model {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                filled[target] = filled.get(target, 0) + dest.shape[0]
        missing = [n for n, rows in expected.items() if filled.get(n, 0) != rows]
        if missing:
            raise ValueError(
                "checkpoint leaves parameters unset: "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
