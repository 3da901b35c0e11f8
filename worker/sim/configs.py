"""Public model configs (config.json as their Hugging Face repos publish them), for
simulated workers: a folder holding one of them is a model `sim:` devices serve.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["PUBLIC_CONFIGS", "write_config"]

# meta-llama/Meta-Llama-3-8B, config.json
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
# facebook/opt-13b, config.json
OPT_13B = {
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 20480,
    "hidden_size": 5120,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "output_projection": True,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 5120,
}
PUBLIC_CONFIGS: dict[str, dict] = {"llama-3-8b": LLAMA_3_8B, "opt-13b": OPT_13B}


def write_config(name: str, folder: str | Path) -> Path:
    """A model folder holding only `name`'s config.json (created if missing); the folder."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(PUBLIC_CONFIGS[name], indent=2) + "\n", encoding="utf-8"
    )
    return path
