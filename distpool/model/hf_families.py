"""The family table: what each Hugging Face `model_type` keeps per layer, and its config defaults.

model_type -> (state family, the defaults its transformers config class assumes for fields a
config.json leaves out, the tag of every layer when no schedule field is present). Pure data; read
by `hf_schedule` (layer tags), `hf_state` (state shapes) and `hf_config` (field defaults). The
defaults of the architectures transformers' runner serves are held against transformers' own config
classes by tests/model_impl/test_spec_agreement.py.
"""

from __future__ import annotations

from typing import Any

_HF_MAMBA2 = {"mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256}
_HF_MAMBA2 |= {"mamba_d_conv": 4, "mamba_expand": 2}
_GDN = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
_GDN |= {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4}
_GEMMA3 = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096}
_KDA = {"linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4}
_KDA |= {"full_attention_interval": 4}  # transformers: layers 4, 8, ... (1-based) are MLA
_MAMBA1 = {"state_size": 16, "conv_kernel": 4, "expand": 2}
_JAMBA = {"mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "attn_layer_period": 8}
_JAMBA |= {"attn_layer_offset": 4}
# transformers' configs of these architectures default to 8 KV heads (not one per query head), and
# Nemotron-H and Qwen3-Next to a head_dim of their own (not hidden_size / heads).
_KV8 = {"num_key_value_heads": 8}
_QWEN_GDN = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_NEMOTRON_H = {"mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8}
_NEMOTRON_H |= _KV8 | {"head_dim": 128}
_ZAMBA2 = {"n_mamba_heads": 8, "mamba_d_state": 64, "mamba_ngroups": 1, "mamba_d_conv": 4, "mamba_expand": 2}
_MAMBA2 = {"num_heads": 128, "head_dim": 64, "state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2}
FAMILIES: dict[str, tuple[str | None, dict[str, Any], str | None]] = {
    "nemotron_h": ("mamba2", _NEMOTRON_H | {"conv_kernel": 4, "expand": 2}, None),
    "falcon_h1": (
        "mamba2",
        _HF_MAMBA2 | _KV8 | {"mamba_d_ssm": 1024},
        "hybrid",
    ),  # attention + Mamba2 in parallel
    # transformers makes every layer Mamba when a Bamba / GraniteMoeHybrid config names no attention layer.
    "granitemoehybrid": ("mamba2", _HF_MAMBA2, "recurrent"),
    "bamba": ("mamba2", _HF_MAMBA2 | _KV8, "recurrent"),
    "zamba2": ("mamba2", _ZAMBA2, None),
    "mamba2": ("mamba2", _MAMBA2, "recurrent"),
    "mamba": ("mamba1", _MAMBA1, "recurrent"),
    "falcon_mamba": ("mamba1", _MAMBA1, "recurrent"),
    "jamba": ("mamba1", _JAMBA | _KV8, None),
    "qwen3_next": ("gated_delta_net", _GDN | {"num_key_value_heads": 2, "head_dim": 256}, None),
    **dict.fromkeys(_QWEN_GDN[1:], ("gated_delta_net", _GDN, None)),
    **dict.fromkeys(("lfm2", "lfm2_moe"), ("short_conv", {"conv_L_cache": 3}, None)),
    "kimi_linear": ("kda", _KDA, None),
    "gemma2": (None, {"head_dim": 256, "sliding_window": 4096, "sliding_window_pattern": 2}, None),
    **dict.fromkeys(("gemma3", "gemma3_text"), (None, _GEMMA3 | {"sliding_window_pattern": 6}, None)),
    **dict.fromkeys(("gemma4", "gemma4_text"), (None, {"head_dim": 256, "global_head_dim": 512}, None)),
}
