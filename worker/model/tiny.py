"""`tiny-random`: a 2-layer random-weight Llama and a byte-level tokenizer, all in memory.

For engine and HTTP tests that need a real model's interfaces, not its
answers. Weights come from a fixed-seed CPU generator, so every process on
every device gets the same model (and the same fingerprint).
"""

from __future__ import annotations

import hashlib

import torch

from pagedkv_base.model_files import CHAT_TEMPLATE, tiny_tokenizer
from worker.model.config import ModelConfig
from worker.model.llama import LlamaForCausalLM
from worker.model.loaded import LoadedModel

__all__ = ["SEED", "TINY_CONFIG", "build_tiny_random", "random_weights"]

SEED = 0

TINY_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=320,  # 3 specials + 256 bytes, rounded up; the rest are never produced by encode
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def random_weights(config: ModelConfig):
    """The tiny model's weights by Hugging Face name, drawn from a fixed seed."""
    gen = torch.Generator().manual_seed(SEED)

    def normal(*shape: int) -> torch.Tensor:
        # std 0.2 (not the usual 0.02) so logits differ enough between tokens
        # for greedy decoding to be stable under float noise.
        return torch.randn(*shape, generator=gen) * 0.2

    c = config
    yield "model.embed_tokens.weight", normal(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", torch.ones(c.hidden_size)
        yield p + "post_attention_layernorm.weight", torch.ones(c.hidden_size)
        yield p + "self_attn.q_proj.weight", normal(c.q_size, c.hidden_size)
        yield p + "self_attn.k_proj.weight", normal(c.kv_size, c.hidden_size)
        yield p + "self_attn.v_proj.weight", normal(c.kv_size, c.hidden_size)
        yield p + "self_attn.o_proj.weight", normal(c.hidden_size, c.q_size)
        yield p + "mlp.gate_proj.weight", normal(c.intermediate_size, c.hidden_size)
        yield p + "mlp.up_proj.weight", normal(c.intermediate_size, c.hidden_size)
        yield p + "mlp.down_proj.weight", normal(c.hidden_size, c.intermediate_size)
    yield "model.norm.weight", torch.ones(c.hidden_size)


def build_tiny_random(device: torch.device, dtype: torch.dtype) -> LoadedModel:
    model = LlamaForCausalLM.create(TINY_CONFIG, device, dtype)
    model.load_weights(random_weights(TINY_CONFIG))
    tokenizer = tiny_tokenizer()
    ident = f"tiny-random/seed={SEED}/{TINY_CONFIG.to_json()}/{CHAT_TEMPLATE}"
    return LoadedModel(
        model=model,
        config=TINY_CONFIG,
        tokenizer=tokenizer,
        fingerprint=hashlib.sha256(ident.encode()).hexdigest(),
        eos_token_ids=(tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")),
        max_model_len=TINY_CONFIG.max_position_embeddings,
        chat_template=CHAT_TEMPLATE,
        name="tiny-random",
    )
