"""Tiny seeded checkpoints of the six architectures the transformers runner serves: a few layers of
32 dims with every layer kind of the architecture present (recurrent, attention, MLP-only, MoE,
attention beside Mamba), saved with `save_pretrained`. Tests and scripts make them at run time;
nothing is downloaded and nothing large is committed."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 64
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
_MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8}
_MAMBA2 |= {"mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 16}
_MOE = {"num_experts_per_tok": 2}
# model_type -> the fields that make it tiny: two or three recurrent layers beside one or two
# attention layers, every layer kind of the architecture present (MLP-only layers, MoE, parallel).
TINY_CONFIGS: dict[str, dict] = {
    "bamba": {"num_hidden_layers": 3, "attn_layer_indices": [1], **_MAMBA2},
    "nemotron_h": {
        "num_hidden_layers": 4,
        "hybrid_override_pattern": "M*M-",
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "n_groups": 1,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 16,
        "head_dim": 8,
    },
    "qwen3_next": {
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "head_dim": 8,
        **_MOE,
    },
    "falcon_h1": {"num_hidden_layers": 2, "mamba_d_ssm": 64, "head_dim": 8, **_MAMBA2},
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 4,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 4,
        **_MOE,
    },
    "granitemoehybrid": {
        "num_hidden_layers": 3,
        "layer_types": ["mamba", "attention", "mamba"],
        "num_local_experts": 4,
        "shared_intermediate_size": 16,
        **_MAMBA2,
        **_MOE,
    },
}


def tiny_config(model_type: str) -> dict:
    """The config.json fields of the tiny `model_type` (what `save_checkpoint` builds it from)."""
    return {"model_type": model_type, **_COMMON, **TINY_CONFIGS[model_type]}


def save_checkpoint(
    model_type: str, folder: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """A tiny random checkpoint of `model_type` in `folder` (config.json and model.safetensors)."""
    config = AutoConfig.for_model(**tiny_config(model_type))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    return folder
