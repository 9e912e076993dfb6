"""ModelSpec.from_hf on public model configs: kinds, layers, KV and state sizes, dtypes, and bad configs.

Fixtures under tests/fixtures are public config.json files, trimmed to the fields that matter. Every
byte count is worked out by hand: layers x (K + V) x kv_heads x head_dim x dtype bytes for KV, and
layers x sum(state tensor elements x dtype bytes) for a slot.
"""

import json
import pickle
from pathlib import Path

import pytest

from distpool.model.hf_config import spec_from_hf
from distpool.model.hf_fields import (
    INVALID_JSON,
    MAX_LAYERS,
    NO_SUCH_FILE,
    NOT_A_CONFIG,
    NOT_AN_OBJECT,
    ConfigFieldMissing,
    ConfigInvalid,
    ConfigUnreadable,
)
from distpool.model.hf_schedule import ScheduleMissing
from distpool.model.spec import (
    DEEPSEEK_V4,
    DENSE,
    HYBRID_MAMBA,
    HYBRID_SWA,
    AttentionSpec,
    ModelSpec,
    StateTensorSpec,
)
from tests.factories import FIXTURES


def spec_of(name: str, **overrides: str | None) -> ModelSpec:
    return spec_from_hf(FIXTURES / f"{name}.json", **overrides)


def config_of(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def state(name: str, shape: tuple[int, ...], dtype: str) -> StateTensorSpec:
    return StateTensorSpec(name=name, shape=shape, dtype=dtype)


def attention(
    kv_heads: int, head_dim: int, v_head_dim: int, window: int | None = None, dtype: str = "bfloat16"
) -> AttentionSpec:
    return AttentionSpec(
        num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype, sliding_window=window
    )


def others(n: int, *taken: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(i for i in range(n) if not any(i in t for t in taken))


# ---- hybrid Mamba ----------------------------------------------------------------------------
def test_nemotron_h_hub_pattern():
    spec = spec_of("nemotron_h")  # NVIDIA-Nemotron-Nano-9B-v2: "M-M-M-MM-M-M-M*-..."
    assert (spec.kind, spec.num_layers, spec.architectures) == (HYBRID_MAMBA, 56, ("NemotronHForCausalLM",))
    assert spec.full_attention_layers == (14, 21, 30, 39)
    assert spec.num_mamba_layers == 27 and spec.mamba_layers[:6] == (0, 2, 4, 6, 7, 9)
    assert spec.sliding_window_layers == () and spec.sliding_attention is None
    assert spec.full_attention == attention(8, 128, 128)
    assert spec.mamba.family == "mamba2"
    # conv_dim = heads * head_dim + 2 * n_groups * state = 128 * 80 + 2 * 8 * 128
    assert spec.mamba.tensors == (
        state("conv", (12288, 3), "bfloat16"),
        state("ssm", (128, 80, 128), "float32"),
    )
    assert spec.full_kv_bytes_per_token == 4 * 2 * 8 * 128 * 2
    assert spec.slot_bytes == 27 * (12288 * 3 * 2 + 128 * 80 * 128 * 4)
    assert (spec.hidden_size, spec.vocab_size, spec.dtype) == (4480, 131072, "bfloat16")


def test_nemotron_h_transformers_layers_block_type():
    spec = spec_of("nemotron_h_transformers")  # Nemotron-H-8B as saved by transformers
    assert (spec.kind, spec.num_layers) == (HYBRID_MAMBA, 52)
    assert spec.full_attention_layers == (7, 18, 29, 40)
    assert spec.num_mamba_layers == 24 and spec.mamba_layers[-3:] == (46, 48, 50)
    assert spec.mamba.tensors == (
        state("conv", (10240, 3), "bfloat16"),
        state("ssm", (128, 64, 128), "float32"),
    )
    assert spec.full_kv_bytes_per_token == 4 * 2 * 8 * 128 * 2
    assert spec.slot_bytes == 24 * ((128 * 64 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4)


def test_nemotron_h_pattern_and_list_forms_agree():
    hub = config_of("nemotron_h")
    names = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    listed = {k: v for k, v in hub.items() if k != "hybrid_override_pattern"}
    listed["layers_block_type"] = [names[c] for c in hub["hybrid_override_pattern"]]
    # Older exports spell n_groups / ssm_state_size as mamba_num_groups / mamba_state_dim.
    listed["mamba_num_groups"], listed["mamba_state_dim"] = (
        listed.pop("n_groups"),
        listed.pop("ssm_state_size"),
    )
    assert spec_from_hf(listed).layout_fields() == spec_of("nemotron_h").layout_fields()


def test_qwen3_next_full_attention_interval():
    spec = spec_of("qwen3_next")
    assert (spec.kind, spec.num_layers) == (HYBRID_MAMBA, 48)
    assert spec.full_attention_layers == tuple(range(3, 48, 4))
    assert spec.mamba_layers == others(48, spec.full_attention_layers)
    assert spec.full_attention == attention(2, 256, 256)
    # conv over q, k, v: 2 * 16 key heads * 128 + 32 value heads * 128
    assert spec.mamba.family == "gated_delta_net"
    assert spec.mamba.tensors == (
        state("conv", (8192, 3), "bfloat16"),
        state("ssm", (32, 128, 128), "float32"),
    )
    assert spec.full_kv_bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert spec.slot_bytes == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)


def test_qwen3_5_nested_text_config():
    spec = spec_of("qwen3_5")  # Qwen3.5-27B: a multimodal wrapper, layer_types in text_config
    assert (spec.kind, spec.num_layers, spec.model_type) == (HYBRID_MAMBA, 64, "qwen3_5")
    assert spec.architectures == ("Qwen3_5ForConditionalGeneration",)
    assert spec.full_attention_layers == tuple(range(3, 64, 4)) and spec.num_mamba_layers == 48
    assert spec.full_attention == attention(4, 256, 256)
    assert spec.mamba.tensors == (
        state("conv", (2 * 16 * 128 + 48 * 128, 3), "bfloat16"),
        state("ssm", (48, 128, 128), "float32"),  # text_config.mamba_ssm_dtype
    )
    assert spec.full_kv_bytes_per_token == 16 * 2 * 4 * 256 * 2
    assert spec.slot_bytes == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4)
    assert (spec.hidden_size, spec.vocab_size) == (5120, 248320)


def test_falcon_h1_parallel_hybrid_lists_every_layer_twice():
    spec = spec_of("falcon_h1")
    assert spec.kind == HYBRID_MAMBA
    assert spec.full_attention_layers == spec.mamba_layers == tuple(range(44))
    assert spec.full_attention == attention(2, 128, 128)
    # intermediate = mamba_d_ssm = 24 heads * 128; conv_dim = 3072 + 2 * 1 group * 256
    assert spec.mamba.tensors == (
        state("conv", (3584, 3), "bfloat16"),
        state("ssm", (24, 128, 256), "float32"),
    )
    assert spec.full_kv_bytes_per_token == 44 * 2 * 2 * 128 * 2
    assert spec.slot_bytes == 44 * (3584 * 3 * 2 + 24 * 128 * 256 * 4)
    auto = config_of("falcon_h1") | {"mamba_d_head": "auto"}  # heads split mamba_d_ssm
    assert spec_from_hf(auto).mamba == spec.mamba


def test_granite_4_h_mamba_and_attention_layer_types():
    spec = spec_of("granite_4_h")
    assert spec.kind == HYBRID_MAMBA
    assert spec.full_attention_layers == (5, 15, 25, 35) and spec.num_mamba_layers == 36
    assert spec.full_attention == attention(8, 4096 // 32, 4096 // 32)
    assert spec.mamba.tensors == (
        state("conv", (128 * 64 + 2 * 1 * 128, 3), "bfloat16"),
        state("ssm", (128, 64, 128), "float32"),
    )
    assert spec.full_kv_bytes_per_token == 4 * 2 * 8 * 128 * 2
    assert spec.slot_bytes == 36 * (8448 * 3 * 2 + 128 * 64 * 128 * 4)


def test_granite_hybrid_class_with_only_attention_is_dense():
    spec = spec_of("granite_dense")  # granite-4.0-micro: GraniteMoeHybrid, attention everywhere
    assert (spec.kind, spec.mamba_layers, spec.mamba) == (DENSE, (), None)
    assert spec.full_attention_layers == tuple(range(40))
    assert spec.full_attention == attention(8, 2560 // 40, 2560 // 40)
    assert (spec.full_kv_bytes_per_token, spec.slot_bytes) == (40 * 2 * 8 * 64 * 2, 0)


def test_jamba_attention_period_and_mamba1_state():
    spec = spec_of("jamba")
    assert spec.kind == HYBRID_MAMBA
    assert spec.full_attention_layers == (4, 12, 20, 28) and spec.num_mamba_layers == 28
    # mamba1: intermediate = mamba_expand * hidden_size = 2 * 4096
    assert spec.mamba.family == "mamba1"
    assert spec.mamba.tensors == (state("conv", (8192, 3), "bfloat16"), state("ssm", (8192, 16), "float32"))
    assert spec.full_kv_bytes_per_token == 4 * 2 * 8 * 128 * 2
    assert spec.slot_bytes == 28 * (8192 * 3 * 2 + 8192 * 16 * 4)


def test_fields_left_out_take_the_defaults_of_transformers_config_classes():
    """Regression: these read as one KV head per query head, hidden / heads and "every layer
    attention" before (tests/model_impl/test_spec_agreement.py holds them against transformers)."""
    jamba = {
        k: v for k, v in config_of("jamba").items() if k not in ("attn_layer_period", "num_key_value_heads")
    }
    spec = spec_from_hf(jamba)
    assert spec.full_attention_layers == (4, 12, 20, 28) and spec.num_mamba_layers == 28
    assert spec.full_attention.num_kv_heads == 8  # not 32, one per query head
    assert spec.full_kv_bytes_per_token == 4 * 2 * 8 * 128 * 2  # was 4 * 2 * 32 * 128 * 2
    nano = {k: v for k, v in config_of("nemotron_h").items() if k != "head_dim"}
    assert spec_from_hf(nano).full_attention.head_dim == 128  # not 4480 / 40 = 112
    qwen = {k: v for k, v in config_of("qwen3_next").items() if k not in ("head_dim", "num_key_value_heads")}
    assert spec_from_hf(qwen).full_attention == attention(2, 256, 256)  # not 16 heads of 2048 / 16


def test_a_hybrid_config_without_its_layer_schedule_is_refused():
    """Regression: it read as a plain transformer, every layer attention and no state at all."""
    config = {k: v for k, v in config_of("nemotron_h").items() if k != "hybrid_override_pattern"}
    with pytest.raises(ScheduleMissing) as err:
        spec_from_hf(config)
    assert (err.value.model_type, err.value.family, err.value.field) == ("nemotron_h", "mamba2", None)


def test_bamba_attention_layer_indices():
    spec = spec_of("bamba")
    assert spec.full_attention_layers == (9, 18, 27) and spec.num_mamba_layers == 29
    assert spec.mamba_layers == others(32, (9, 18, 27))
    assert spec.mamba.tensors == (
        state("conv", (8448, 3), "bfloat16"),
        state("ssm", (128, 64, 128), "float32"),
    )
    assert spec.full_kv_bytes_per_token == 3 * 2 * 8 * 128 * 2
    assert spec.slot_bytes == 29 * (8448 * 3 * 2 + 128 * 64 * 128 * 4)


def test_zamba2_hybrid_layers_hold_attention_and_mamba():
    spec = spec_of("zamba2")
    assert spec.kind == HYBRID_MAMBA
    assert spec.full_attention_layers == (6, 12, 18, 24, 30, 36, 42, 47, 51)
    assert spec.mamba_layers == tuple(range(54))
    assert spec.full_attention == attention(32, 160, 160)  # attention_head_dim = 2 * 2560 / 32
    # 80 heads * mamba_headdim 64 + 2 * 1 group * 64 state
    assert spec.mamba.tensors == (state("conv", (5248, 3), "bfloat16"), state("ssm", (80, 64, 64), "float32"))
    assert spec.full_kv_bytes_per_token == 9 * 2 * 32 * 160 * 2
    assert spec.slot_bytes == 54 * (5248 * 3 * 2 + 80 * 64 * 64 * 4)
    ids_only = {
        k: v for k, v in config_of("zamba2").items() if k not in ("layers_block_type", "attention_head_dim")
    }
    assert spec_from_hf(ids_only).layout_fields() == spec.layout_fields()


def test_lfm2_short_conv_state():
    spec = spec_of("lfm2")  # LFM2-1.2B: full_attn_idxs, no layer_types
    assert spec.kind == HYBRID_MAMBA
    assert spec.full_attention_layers == (2, 5, 8, 10, 12, 14)
    assert spec.mamba_layers == others(16, spec.full_attention_layers)
    assert spec.full_attention == attention(8, 2048 // 32, 2048 // 32)
    assert spec.mamba.family == "short_conv"
    assert spec.mamba.tensors == (state("conv", (2048, 3 - 1), "bfloat16"),)
    assert spec.full_kv_bytes_per_token == 6 * 2 * 8 * 64 * 2
    assert spec.slot_bytes == 10 * 2048 * 2 * 2
    typed = {k: v for k, v in config_of("lfm2").items() if k != "full_attn_idxs"}
    typed["layer_types"] = ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]
    assert spec_from_hf(typed).layout_fields() == spec.layout_fields()


def test_kimi_linear_mla_and_kda():
    spec = spec_of("kimi_linear")
    assert spec.kind == HYBRID_MAMBA
    assert spec.full_attention_layers == (3, 7, 11, 15, 19, 23, 26)  # 1-based in linear_attn_config
    assert spec.num_mamba_layers == 20 and spec.mamba_layers[:4] == (0, 1, 2, 4)
    assert spec.full_attention == attention(1, 512 + 64, 0)  # one MLA latent
    conv = (32 * 128, 4 - 1)
    assert spec.mamba.family == "kda"
    assert spec.mamba.tensors == (
        state("conv_q", conv, "bfloat16"),
        state("conv_k", conv, "bfloat16"),
        state("conv_v", conv, "bfloat16"),
        state("recurrent", (32, 128, 128), "float32"),
    )
    assert spec.full_kv_bytes_per_token == 7 * (512 + 64) * 2
    assert spec.slot_bytes == 20 * (3 * 4096 * 3 * 2 + 32 * 128 * 128 * 4)


# ---- hybrid SWA ------------------------------------------------------------------------------
def test_gpt_oss_alternating_layer_types():
    spec = spec_of("gpt_oss")  # no torch_dtype in the config: bfloat16
    assert (spec.kind, spec.dtype, spec.sliding_window) == (HYBRID_SWA, "bfloat16", 128)
    assert spec.full_attention_layers == tuple(range(1, 24, 2))
    assert spec.sliding_window_layers == tuple(range(0, 24, 2))
    assert spec.full_attention == attention(8, 64, 64)
    assert spec.sliding_attention == attention(8, 64, 64, window=128)
    assert spec.full_kv_bytes_per_token == spec.swa_kv_bytes_per_token == 12 * 2 * 8 * 64 * 2
    assert (spec.mamba, spec.slot_bytes) == (None, 0)


def test_llama4_chunked_layers_count_as_sliding():
    spec = spec_of("llama4")
    assert (spec.kind, spec.model_type, spec.num_layers) == (HYBRID_SWA, "llama4", 48)
    assert spec.full_attention_layers == tuple(range(3, 48, 4))  # NoPE layers attend globally
    assert spec.num_sliding_window_layers == 36 and spec.sliding_window_layers[:4] == (0, 1, 2, 4)
    assert spec.sliding_attention == attention(8, 128, 128, window=8192)
    assert spec.full_kv_bytes_per_token == 12 * 2 * 8 * 128 * 2
    assert spec.swa_kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    default = config_of("llama4")
    default["text_config"]["no_rope_layers"] = []  # transformers' default: every 4th layer is NoPE
    assert spec_from_hf(default).layout_fields() == spec.layout_fields()


def test_mimo_v2_flash_hybrid_layer_pattern():
    spec = spec_of("mimo_v2_flash")
    assert spec.kind == HYBRID_SWA
    assert spec.full_attention_layers == (0, 5, 11, 17, 23, 29, 35, 41, 47)
    assert spec.num_sliding_window_layers == 39
    assert spec.full_attention == attention(4, 192, 128)
    assert spec.sliding_attention == attention(8, 192, 128, window=128)
    assert spec.full_kv_bytes_per_token == 9 * 4 * (192 + 128) * 2
    assert spec.swa_kv_bytes_per_token == 39 * 8 * (192 + 128) * 2


def test_gemma3_sliding_window_pattern_is_hybrid_swa():
    spec = spec_of("gemma3")  # gemma-3-12b-it: every 6th layer global
    assert (spec.kind, spec.architectures) == (HYBRID_SWA, ("Gemma3ForConditionalGeneration",))
    assert spec.full_attention_layers == tuple(range(5, 48, 6))
    assert spec.num_sliding_window_layers == 40
    assert spec.sliding_attention == attention(8, 256, 256, window=1024)
    assert spec.full_kv_bytes_per_token == 8 * 2 * 8 * 256 * 2


def test_gemma2_alternation_decided_by_structure():
    gemma2 = {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_size": 3584,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "sliding_window": 4096,
        "torch_dtype": "float32",
    }
    spec = spec_from_hf(gemma2)
    assert spec.kind == HYBRID_SWA
    assert spec.sliding_window_layers == tuple(range(0, 42, 2))
    assert spec.full_attention == attention(8, 256, 256, dtype="float32")
    assert spec.full_kv_bytes_per_token == 21 * 2 * 8 * 256 * 4


def test_gemma4_global_layers_have_their_own_shape():
    spec = spec_of("gemma4")  # 26B-A4B: global_head_dim 512, num_global_key_value_heads 2
    assert spec.kind == HYBRID_SWA
    assert spec.full_attention_layers == (5, 11, 17, 23, 29)
    assert spec.full_attention == attention(2, 512, 512)
    assert spec.sliding_attention == attention(8, 256, 256, window=1024)
    assert spec.full_kv_bytes_per_token == 5 * 2 * 2 * 512 * 2
    assert spec.swa_kv_bytes_per_token == 25 * 2 * 8 * 256 * 2


def test_kv_shared_layers_cache_nothing():
    shared = config_of("gemma4")
    shared["text_config"]["num_kv_shared_layers"] = 6
    spec = spec_from_hf(shared)
    assert spec.num_layers == 30
    assert spec.full_attention_layers == (5, 11, 17, 23)
    assert spec.sliding_window_layers == others(24, (5, 11, 17, 23))


def test_deepseek_v4_is_its_own_kind():
    spec = spec_of("deepseek_v4")  # compress_ratios lists 43 layers + 1 MTP layer
    assert (spec.kind, spec.num_layers) == (DEEPSEEK_V4, 43)
    assert spec.sliding_window_layers == tuple(range(43))
    assert spec.full_attention_layers == tuple(range(2, 43))  # compress ratio 4 or 128
    assert spec.sliding_attention == attention(1, 512, 0, window=128)
    assert spec.full_attention == attention(1, 512, 0)
    assert spec.full_kv_bytes_per_token == 41 * 512 * 2
    assert spec.swa_kv_bytes_per_token == 43 * 512 * 2
    assert not spec.is_hybrid
    typed = {k: v for k, v in config_of("deepseek_v4").items() if k != "compress_ratios"}
    csa_hca = ["compressed_sparse_attention", "heavily_compressed_attention"]
    typed["layer_types"] = ["sliding_attention"] * 2 + csa_hca * 20 + csa_hca[:1]  # transformers' form
    assert spec_from_hf(typed).layout_fields() == spec.layout_fields()


# ---- dense -----------------------------------------------------------------------------------
def test_mistral_window_on_every_layer_is_dense():
    spec = spec_of("mistral")
    # One kind of layer: a plain KV pool, the window kept on the attention spec.
    assert (spec.kind, spec.full_attention_layers, spec.sliding_window_layers) == (
        DENSE,
        tuple(range(32)),
        (),
    )
    assert spec.full_attention == attention(8, 128, 128, window=4096)
    assert (spec.full_kv_bytes_per_token, spec.swa_kv_bytes_per_token) == (32 * 2 * 8 * 128 * 2, 0)


def test_llama3_dense():
    spec = spec_of("llama3")  # no head_dim: hidden_size / num_attention_heads
    assert (spec.kind, spec.full_attention_layers) == (DENSE, tuple(range(32)))
    assert spec.full_attention == attention(8, 4096 // 32, 4096 // 32)
    assert (spec.full_kv_bytes_per_token, spec.slot_bytes) == (32 * 2 * 8 * 128 * 2, 0)


def test_pure_mamba2_is_dense_with_mamba_layers():
    spec = spec_of("mamba2")  # Mamba-Codestral-7B
    assert (spec.kind, spec.full_attention, spec.full_attention_layers) == (DENSE, None, ())
    assert spec.mamba_layers == tuple(range(64))
    assert spec.mamba.tensors == (
        state("conv", (128 * 64 + 2 * 8 * 128, 3), "bfloat16"),
        state("ssm", (128, 64, 128), "float32"),
    )
    assert (spec.full_kv_bytes_per_token, spec.slot_bytes) == (0, 64 * (10240 * 3 * 2 + 128 * 64 * 128 * 4))


def test_mla_latent_is_one_kv_head():
    mla = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "hidden_size": 7168,
    }
    spec = spec_from_hf(mla | {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_key_value_heads": 128})
    assert (spec.kind, spec.full_attention) == (DENSE, attention(1, 512 + 64, 0))
    assert spec.full_kv_bytes_per_token == 61 * 576 * 2


def test_fields_that_switch_a_feature_off():
    # Qwen2.5 states a window but turns it off; a null layer_types means "not given".
    qwen25 = config_of("llama3") | {
        "sliding_window": 131072,
        "use_sliding_window": False,
        "layer_types": None,
    }
    assert spec_from_hf(qwen25).full_attention_layers == tuple(range(32))
    # A Gemma 3 text config with sliding_window null: the family default window does not come back.
    gemma3 = config_of("gemma3")
    gemma3["text_config"]["sliding_window"] = None
    assert (spec_from_hf(gemma3).kind, spec_from_hf(gemma3).num_sliding_window_layers) == (DENSE, 0)
    # GraniteMoeHybrid without layer_types: transformers makes every layer Mamba, so no attention at all.
    no_types = {k: v for k, v in config_of("granite_4_h").items() if k != "layer_types"}
    assert (spec_from_hf(no_types).kind, spec_from_hf(no_types).num_mamba_layers) == (DENSE, 40)


def test_other_wrappers_and_moe_pattern_letters():
    wrapped = {"architectures": ["InternVLChatModel"], "llm_config": config_of("llama3")}
    assert spec_from_hf(wrapped).layout_fields() == spec_of("llama3").layout_fields()
    assert spec_from_hf(wrapped).architectures == ("InternVLChatModel",)
    moe = config_of("nemotron_h") | {"hybrid_override_pattern": "MEMEM*EMEMEM*E", "num_hidden_layers": 14}
    spec = spec_from_hf(moe)
    assert (spec.full_attention_layers, spec.mamba_layers) == ((5, 12), (0, 2, 4, 7, 9, 11))


def test_unknown_architecture_is_classified_by_structure():
    plain = config_of("llama3") | {"architectures": ["FooForCausalLM"], "model_type": "foo"}
    assert spec_from_hf(plain).kind == DENSE
    gdn = {k: v for k, v in config_of("qwen3_next").items() if k != "full_attention_interval"}
    gdn |= {"model_type": "bar", "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    spec = spec_from_hf(gdn | {"num_hidden_layers": 4})
    assert (spec.kind, spec.full_attention_layers, spec.mamba.family) == (
        HYBRID_MAMBA,
        (3,),
        "gated_delta_net",
    )


# ---- dtypes ------------------------------------------------------------------------------------
def test_dtype_overrides():
    spec = spec_of("nemotron_h", kv_dtype="float32", conv_dtype="fp32", ssm_dtype="bf16")
    assert spec.dtype == "bfloat16"  # the model's own dtype is unchanged
    assert spec.full_attention.dtype == "float32"
    assert spec.full_kv_bytes_per_token == 4 * 2 * 8 * 128 * 4
    assert spec.slot_bytes == 27 * (12288 * 3 * 4 + 128 * 80 * 128 * 2)
    assert spec_of("gpt_oss", kv_dtype="half").sliding_attention.dtype == "float16"
    assert spec_of("llama3", kv_dtype=None) == spec_of("llama3")


def test_model_dtype_auto_and_ssm_cache_dtype():
    assert spec_from_hf(config_of("llama3") | {"torch_dtype": "auto"}).dtype == "bfloat16"
    half = spec_from_hf(config_of("jamba") | {"torch_dtype": "float16", "mamba_ssm_cache_dtype": "auto"})
    assert [t.dtype for t in half.mamba.tensors] == ["float16", "float16"]
    assert half.full_attention.dtype == "float16"
    fp16_ssm = spec_from_hf(config_of("bamba") | {"mamba_ssm_cache_dtype": "float16"})
    assert fp16_ssm.mamba.tensors[1].dtype == "float16"


# ---- paths and malformed configs ---------------------------------------------------------------
def test_directory_holding_config_json(tmp_path):
    (tmp_path / "config.json").write_text((FIXTURES / "qwen3_next.json").read_text())
    spec = spec_from_hf(tmp_path)
    assert spec.source == str(tmp_path / "config.json")
    assert spec.layout_fields() == spec_of("qwen3_next").layout_fields()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("fixture", "change", "field", "value"),
    [
        ("nemotron_h", {"num_key_value_heads": "8"}, "num_key_value_heads", "8"),
        ("nemotron_h", {"num_hidden_layers": -1}, "num_hidden_layers", -1),
        ("nemotron_h", {"head_dim": True}, "head_dim", True),
        ("nemotron_h", {"hybrid_override_pattern": "M-M*"}, "hybrid_override_pattern", 4),  # 4 layers of 56
        ("nemotron_h", {"hybrid_override_pattern": "MX" * 28}, "hybrid_override_pattern", ["X"]),
        ("nemotron_h", {"n_groups": None, "model_type": "nemotron_x"}, "n_groups", None),
        ("nemotron_h", {"torch_dtype": "int3"}, "torch_dtype", "int3"),
        ("nemotron_h", {"architectures": "NemotronHForCausalLM"}, "architectures", "NemotronHForCausalLM"),
        ("gpt_oss", {"layer_types": ["full_attention"] * 23 + ["retention"]}, "layer_types[23]", "retention"),
        ("gpt_oss", {"layer_types": ["full_attention"] * 12}, "layer_types", 12),  # 12 layers of 24
        ("gpt_oss", {"sliding_window": None}, "sliding_window", None),
        ("bamba", {"attn_layer_indices": [9, 18, 32]}, "attn_layer_indices", [9, 18, 32]),
        ("kimi_linear", {"linear_attn_config": [4, 8]}, "linear_attn_config", [4, 8]),
        ("deepseek_v4", {"compress_ratios": [0] * 40}, "compress_ratios", 40),  # for 43 layers
        ("qwen3_5", {"text_config": {"model_type": "qwen3_5_text"}}, "text_config.num_hidden_layers", None),
    ],
)
def test_malformed_field_names_file_and_field(tmp_path, fixture, change, field, value):
    config = {k: v for k, v in (config_of(fixture) | change).items() if v is not None}
    path = _write(tmp_path, json.dumps(config))
    for target, source in ((path, str(path)), (config, "<dict>")):
        with pytest.raises(ConfigInvalid) as err:
            spec_from_hf(target)
        assert (err.value.source, err.value.field, err.value.value) == (source, field, value)
        assert str(err.value).startswith(f"{source}: ") and isinstance(err.value, ValueError)
        assert isinstance(err.value, ConfigFieldMissing) == (value is None)
        copy = pickle.loads(pickle.dumps(err.value))  # crosses Ray's process boundary as itself
        assert (type(copy), copy.field, copy.value, str(copy)) == (
            type(err.value),
            field,
            value,
            str(err.value),
        )


def test_a_missing_field_names_its_other_spellings():
    config = {k: v for k, v in config_of("bamba").items() if k != "num_hidden_layers"}
    with pytest.raises(ConfigFieldMissing) as err:
        spec_from_hf(config)
    assert (err.value.field, err.value.alternatives) == ("num_hidden_layers", ("num_layers", "n_layer"))


def test_unreadable_configs(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    cases = [
        (_write(tmp_path, "{not json"), INVALID_JSON, "config.json"),
        (tmp_path / "missing.json", NO_SUCH_FILE, "missing.json"),
        (tmp_path / "empty_dir", NO_SUCH_FILE, "empty_dir/config.json"),
    ]
    for path, problem, source in cases:
        with pytest.raises(ConfigUnreadable) as err:
            spec_from_hf(path)
        assert (err.value.problem, err.value.source) == (problem, str(tmp_path / source))
    _write(tmp_path, "[1, 2]")
    with pytest.raises(ConfigUnreadable) as err:
        spec_from_hf(tmp_path / "config.json")
    assert (err.value.problem, err.value.detail) == (NOT_AN_OBJECT, "list")
    with pytest.raises(ConfigUnreadable) as err:
        spec_from_hf(42)
    assert (err.value.source, err.value.problem) == ("<int>", NOT_A_CONFIG)
    assert pickle.loads(pickle.dumps(err.value)).problem == NOT_A_CONFIG


def test_unknown_architecture_without_standard_fields():
    with pytest.raises(ConfigInvalid) as err:
        spec_from_hf({"architectures": ["RwkvForCausalLM"], "model_type": "rwkv", "hidden_size": 2048})
    assert (err.value.source, err.value.field, err.value.value) == ("<dict>", None, "RwkvForCausalLM")
    assert all(name in err.value.expected for name in ("layer_types", "hybrid_override_pattern"))


def test_recurrent_layers_without_a_known_state_family():
    minimax = config_of("llama3") | {"model_type": "minimax", "attn_type_list": [0] * 31 + [1]}
    with pytest.raises(ConfigInvalid) as err:
        spec_from_hf(minimax)
    assert (err.value.field, err.value.value) == (None, "minimax")


def test_bad_overrides():
    with pytest.raises(ConfigInvalid) as err:
        spec_of("llama3", kv_dtype="int4")
    assert (err.value.field, err.value.value) == ("override kv_dtype", "int4")
    with pytest.raises(ConfigInvalid) as err:
        spec_of("llama3", cache_dtype="float32")
    assert (err.value.field, err.value.value) == ("overrides", ["cache_dtype"])


@pytest.mark.parametrize("fixture", ["llama3", "falcon_h1", "lfm2", "jamba", "mamba2", "qwen3_next"])
@pytest.mark.parametrize("layers", [MAX_LAYERS + 1, 10**12, 10**20])
def test_a_layer_count_beyond_any_model_is_refused_before_building_per_layer_lists(fixture, layers):
    config = {**config_of(fixture), "num_hidden_layers": layers}  # 10**12 layers: a MemoryError once
    with pytest.raises(ConfigInvalid) as err:
        spec_from_hf(config)
    assert (err.value.field, err.value.value, err.value.expected) == (
        "num_hidden_layers",
        layers,
        f"at most {MAX_LAYERS}",
    )


def test_per_layer_lists_and_patterns_longer_than_any_model_are_refused():
    config = {**config_of("nemotron_h"), "num_hidden_layers": None}
    with pytest.raises(ConfigInvalid) as err:
        spec_from_hf({**config, "hybrid_override_pattern": "M*" * (MAX_LAYERS // 2) + "M"})
    assert (err.value.field, err.value.value) == ("hybrid_override_pattern", MAX_LAYERS + 1)
    with pytest.raises(ConfigInvalid) as err:
        spec_from_hf(
            {
                **config_of("llama3"),
                "num_hidden_layers": None,
                "layer_types": ["full_attention"] * (MAX_LAYERS + 1),
            }
        )
    assert (err.value.field, err.value.value) == ("layer_types", MAX_LAYERS + 1)
    assert (
        spec_from_hf({**config, "hybrid_override_pattern": "M*" * (MAX_LAYERS // 2)}).num_layers == MAX_LAYERS
    )
