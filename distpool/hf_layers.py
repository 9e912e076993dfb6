"""What each layer of a Hugging Face model holds: the layer schedule, the family table, state shapes.

Only `distpool.hf_config` uses this module. A *schedule* is one tag per decoder layer:

    full            full attention (KV grows with the sequence)
    sliding         sliding-window attention (`sliding_window` tokens)
    chunked         chunked local attention (Llama 4; `attention_chunk_size` tokens, counted as sliding)
    recurrent       Mamba / linear attention / short conv (fixed-size state)
    hybrid          full attention and a recurrent state in one layer (Falcon-H1, Zamba2 "hybrid")
    hybrid_sliding  sliding-window attention and a recurrent state in one layer
    none            no per-request memory (Nemotron-H MLP / MoE blocks, KV-sharing layers)

Schedule readers are tried in table order; the first whose field is present decides every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distpool.spec import MambaSpec, StateTensorSpec

if TYPE_CHECKING:
    from distpool.hf_config import ConfigFields

# The attention a tagged layer caches (None: no KV), and the tags that keep a recurrent state.
ATTENTION_OF_TAG = {"full": "full", "hybrid": "full", "sliding": "sliding", "hybrid_sliding": "sliding"}
ATTENTION_OF_TAG |= {"chunked": "chunked", "recurrent": None, "none": None}
RECURRENT_TAGS = frozenset({"recurrent", "hybrid", "hybrid_sliding"})
NUM_LAYERS = ("num_hidden_layers", "num_layers", "n_layer")

# Values of `layer_types` / `layers_block_type` across transformers' config classes and Hub configs.
_LAYER_TYPE_TAGS = {
    **dict.fromkeys(("full_attention", "attention", "global_attention", "global", "full"), "full"),
    # Sparse attention with an indexer (DeepSeek-V3.2 DSA, MiniMax-M3) still caches every token's KV.
    **dict.fromkeys(("deepseek_sparse_attention", "indexed_attention", "minimax_m3_sparse"), "full"),
    **dict.fromkeys(("sliding_attention", "sliding_window_attention", "local_attention", "local"), "sliding"),
    "chunked_attention": "chunked",
    **dict.fromkeys(("linear_attention", "mamba", "mamba2", "conv", "short_conv", "linear"), "recurrent"),
    "hybrid": "hybrid",
    "hybrid_sliding": "hybrid_sliding",
    **dict.fromkeys(("mlp", "moe", "dense", "sparse"), "none"),
}
# Nemotron-H `hybrid_override_pattern`: M Mamba2, * attention, - MLP, E MoE.
_PATTERN_TAGS = {"M": "recurrent", "*": "full", "-": "none", "E": "none"}
Reader = Callable[["ConfigFields", str], "list[str] | None"]


def _checked_length(f: ConfigFields, field: str, tags: list[str]) -> list[str]:
    """Explicit per-layer lists decide the layer count; a stated `num_hidden_layers` must agree."""
    stated = f.int(*NUM_LAYERS, default=None)
    if not tags or (stated is not None and stated != len(tags)):
        raise f.error(f"field {f.name(field)!r} lists {len(tags)} layers but num_hidden_layers is {stated}")
    return tags


def _named_types(field: str) -> Reader:
    def read(f: ConfigFields, _: str) -> list[str] | None:
        if f.data.get(field) is None:
            return None
        tags = []
        for i, value in enumerate(f.seq(field)):
            tag = _LAYER_TYPE_TAGS.get(value.lower()) if isinstance(value, str) else None
            if tag is None:
                known = ", ".join(sorted(_LAYER_TYPE_TAGS))
                raise f.error(f"field {f.name(field)}[{i}] is {value!r}, not a known layer type ({known})")
            tags.append(tag)
        return _checked_length(f, field, tags)

    return read


def _override_pattern(f: ConfigFields, _: str) -> list[str] | None:
    pattern = f.text("hybrid_override_pattern")
    if pattern is None:
        return None
    bad = sorted({c for c in pattern if c not in _PATTERN_TAGS})
    if bad:
        raise f.error(
            f"field {f.name('hybrid_override_pattern')!r} has unknown characters {bad} (known: M * - E)"
        )
    return _checked_length(f, "hybrid_override_pattern", [_PATTERN_TAGS[c] for c in pattern])


def _indices(f: ConfigFields, field: str, n: int, first: int = 0) -> set[int]:
    values = f.int_list(field, minimum=first)
    out = {v - first for v in values}
    if any(i >= n for i in out) or len(out) != len(values):
        raise f.error(f"field {f.name(field)!r} = {values} must name distinct layers among {n}")
    return out


def _kimi_linear(f: ConfigFields, _: str) -> list[str] | None:
    """Kimi-Linear: `linear_attn_config` lists 1-based `full_attn_layers` and `kda_layers`."""
    if not f.has("linear_attn_config"):
        return None
    sub, n = f.sub("linear_attn_config"), f.int(*NUM_LAYERS)
    if not sub.has("full_attn_layers"):
        return None
    full, kda = _indices(sub, "full_attn_layers", n, first=1), _indices(sub, "kda_layers", n, first=1)
    if full & kda or len(full | kda) != n:
        raise sub.error(
            f"{sub.name('full_attn_layers')} and {sub.name('kda_layers')} must split all {n} layers"
        )
    return ["full" if i in full else "recurrent" for i in range(n)]


def _binary_list(field: str, one: str, zero: str) -> Reader:
    def read(f: ConfigFields, _: str) -> list[str] | None:
        if f.data.get(field) is None:
            return None
        values = f.int_list(field)
        if any(v > 1 for v in values):
            raise f.error(f"field {f.name(field)!r} must hold only 0 and 1, got {values}")
        return _checked_length(f, field, [one if v else zero for v in values])

    return read


def _by_index(field: str, listed: str, others: str) -> Reader:
    def read(f: ConfigFields, _: str) -> list[str] | None:
        if not f.has(field):
            return None
        n = f.int(*NUM_LAYERS)
        chosen = _indices(f, field, n)
        return [listed if i in chosen else others for i in range(n)]

    return read


def _jamba_period(f: ConfigFields, _: str) -> list[str] | None:
    if not f.has("attn_layer_period"):
        return None
    period, offset, n = f.int("attn_layer_period"), f.int("attn_layer_offset", minimum=0), f.int(*NUM_LAYERS)
    if offset >= period:
        raise f.error(f"attn_layer_offset ({offset}) must be smaller than attn_layer_period ({period})")
    return ["full" if i % period == offset else "recurrent" for i in range(n)]


def _every_nth(field: str, nth: str, others: str) -> Reader:
    """Layer i is `nth` when (i + 1) is a multiple of the field's value (Qwen3-Next, Gemma 2/3)."""

    def read(f: ConfigFields, _: str) -> list[str] | None:
        # A window pattern without a window (Gemma with sliding_window null) leaves every layer global.
        if f.find(field) is None or (others == "sliding" and f.find("sliding_window") is None):
            return None
        every, n = f.int(field), f.int(*NUM_LAYERS)
        return [nth if (i + 1) % every == 0 else others for i in range(n)]

    return read


def _llama4_chunks(f: ConfigFields, model_type: str) -> list[str] | None:
    """Llama 4: `no_rope_layers[i]` is 1 where layer i uses RoPE and attends within its chunk."""
    if not f.has("attention_chunk_size"):
        return None
    n = f.int(*NUM_LAYERS)
    if f.data.get("no_rope_layers"):
        flags = f.int_list("no_rope_layers")
        if len(flags) != n or any(v > 1 for v in flags):
            raise f.error(f"field {f.name('no_rope_layers')!r} must hold {n} values of 0 or 1, got {flags}")
    elif model_type in ("llama4", "llama4_text"):  # transformers' default: every 4th layer is NoPE, global
        every = f.int("no_rope_layer_interval", default=4)
        flags = [int((i + 1) % every != 0) for i in range(n)]
    else:
        return None
    return ["chunked" if v else "full" for v in flags]


SCHEDULE_READERS: tuple[tuple[str, Reader], ...] = (
    ("linear_attn_config", _kimi_linear),
    ("hybrid_override_pattern", _override_pattern),  # Nemotron-H (Hub)
    ("layers_block_type", _named_types("layers_block_type")),  # Nemotron-H (transformers), Zamba2
    ("layer_types", _named_types("layer_types")),
    ("hybrid_layer_pattern", _binary_list("hybrid_layer_pattern", "sliding", "full")),  # MiMo: 1 = SWA
    ("attn_type_list", _binary_list("attn_type_list", "full", "recurrent")),  # MiniMax: 0 = linear
    ("attn_layer_indices", _by_index("attn_layer_indices", "full", "recurrent")),  # Bamba
    ("attn_layer_period", _jamba_period),  # Jamba
    ("full_attention_interval", _every_nth("full_attention_interval", "full", "recurrent")),  # Qwen3-Next
    ("full_attn_idxs", _by_index("full_attn_idxs", "full", "recurrent")),  # LFM2
    ("hybrid_layer_ids", _by_index("hybrid_layer_ids", "hybrid", "recurrent")),  # Zamba2
    ("attention_chunk_size", _llama4_chunks),
    ("sliding_window_pattern", _every_nth("sliding_window_pattern", "full", "sliding")),  # Gemma 2/3
)
SCHEDULE_FIELDS = tuple(name for name, _ in SCHEDULE_READERS)


def layer_schedule(f: ConfigFields, model_type: str) -> list[str] | None:
    """One tag per layer, or None when nothing but a uniform transformer layout is stated."""
    for _, read in SCHEDULE_READERS:
        tags = read(f, model_type)
        if tags is not None:
            return tags
    every_layer = FAMILIES.get(model_type, (None, {}, None))[2]
    return [every_layer] * f.int(*NUM_LAYERS) if every_layer else None


# ---- the family table ----------------------------------------------------------------------
# model_type -> (state family, defaults its transformers config class assumes for fields a
# config.json leaves out, the tag of every layer when no schedule field is present).
_HF_MAMBA2 = {"mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256}
_HF_MAMBA2 |= {"mamba_d_conv": 4, "mamba_expand": 2}
_GDN = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
_GDN |= {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4}
_GEMMA3 = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096}
_KDA = {"linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4}
_KDA |= {"full_attention_interval": 4}  # transformers: layers 4, 8, ... (1-based) are MLA
_MAMBA1 = {"state_size": 16, "conv_kernel": 4, "expand": 2}
_JAMBA = {"mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "attn_layer_offset": 4}
_QWEN_GDN = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_NEMOTRON_H = {"mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8}
_ZAMBA2 = {"n_mamba_heads": 8, "mamba_d_state": 64, "mamba_ngroups": 1, "mamba_d_conv": 4, "mamba_expand": 2}
_MAMBA2 = {"num_heads": 128, "head_dim": 64, "state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2}
FAMILIES: dict[str, tuple[str | None, dict[str, Any], str | None]] = {
    "nemotron_h": ("mamba2", _NEMOTRON_H | {"conv_kernel": 4, "expand": 2}, None),
    "falcon_h1": ("mamba2", _HF_MAMBA2 | {"mamba_d_ssm": 1024}, "hybrid"),  # attention + Mamba2 in parallel
    # transformers makes every layer Mamba when a Bamba / GraniteMoeHybrid config names no attention layer.
    "granitemoehybrid": ("mamba2", _HF_MAMBA2, "recurrent"),
    "bamba": ("mamba2", _HF_MAMBA2, "recurrent"),
    "zamba2": ("mamba2", _ZAMBA2, None),
    "mamba2": ("mamba2", _MAMBA2, "recurrent"),
    "mamba": ("mamba1", _MAMBA1, "recurrent"),
    "falcon_mamba": ("mamba1", _MAMBA1, "recurrent"),
    "jamba": ("mamba1", _JAMBA, None),
    **dict.fromkeys(_QWEN_GDN, ("gated_delta_net", _GDN, None)),
    **dict.fromkeys(("lfm2", "lfm2_moe"), ("short_conv", {"conv_L_cache": 3}, None)),
    "kimi_linear": ("kda", _KDA, None),
    "gemma2": (None, {"head_dim": 256, "sliding_window": 4096, "sliding_window_pattern": 2}, None),
    **dict.fromkeys(("gemma3", "gemma3_text"), (None, _GEMMA3 | {"sliding_window_pattern": 6}, None)),
    **dict.fromkeys(("gemma4", "gemma4_text"), (None, {"head_dim": 256, "global_head_dim": 512}, None)),
}


# ---- recurrent state shapes ----------------------------------------------------------------
# Shapes follow SGLang/vLLM's state caches at tensor-parallel size 1; a conv state is
# (channels, kernel - 1): the last kernel - 1 inputs of every channel.
_M2_HEADS = ("mamba_num_heads", "mamba_n_heads", "n_mamba_heads")
_M2_HEAD_DIM = ("mamba_head_dim", "mamba_d_head", "mamba_headdim")
_M2_STATE = ("ssm_state_size", "mamba_d_state", "mamba_state_dim")
_M2_GROUPS = ("n_groups", "mamba_n_groups", "mamba_ngroups", "mamba_num_groups")
_CONV_KERNEL = ("conv_kernel", "mamba_d_conv", "mamba_conv_kernel")
_EXPAND = ("mamba_expand", "expand")
_HIDDEN = ("hidden_size", "d_model")
_PURE_MAMBA = ("mamba", "mamba2", "falcon_mamba")  # their config classes drop the mamba_ prefix


def _names(names: tuple[str, ...], unprefixed: str, model_type: str) -> tuple[str, ...]:
    return (*names, unprefixed) if model_type in _PURE_MAMBA else names


def _conv(name: str, channels: int, kernel: int, dtype: str) -> StateTensorSpec:
    return StateTensorSpec(name=name, shape=(channels, kernel - 1), dtype=dtype)


def _mamba2(f: ConfigFields, model_type: str, conv_dtype: str, ssm_dtype: str) -> tuple[StateTensorSpec, ...]:
    heads = f.int(*_names(_M2_HEADS, "num_heads", model_type))
    head_dim_names = _names(_M2_HEAD_DIM, "head_dim", model_type)
    d_ssm = f.int("mamba_d_ssm", default=None)
    found = f.find(*head_dim_names)
    if found is None or found[1] == "auto":
        # Bamba, Granite-4.0-H, Falcon-H1, Zamba2: the heads split the intermediate size, which is
        # mamba_d_ssm (Falcon-H1) or mamba_expand * hidden_size.
        intermediate = d_ssm or f.int(*_EXPAND) * f.int(*_HIDDEN)
        if intermediate % heads:
            raise f.error(f"the Mamba intermediate size {intermediate} does not split into {heads} heads")
        head_dim = intermediate // heads
    else:
        head_dim = f.int(*head_dim_names)
    if d_ssm is not None and d_ssm != heads * head_dim:
        raise f.error(f"mamba_d_ssm ({d_ssm}) must equal Mamba heads x head dim ({heads} x {head_dim})")
    state, groups = f.int(*_names(_M2_STATE, "state_size", model_type)), f.int(*_M2_GROUPS)
    conv_dim = heads * head_dim + 2 * groups * state  # x, B and C all pass the conv
    conv = _conv("conv", conv_dim, f.int(*_CONV_KERNEL, minimum=2), conv_dtype)
    return conv, StateTensorSpec(name="ssm", shape=(heads, head_dim, state), dtype=ssm_dtype)


def _mamba1(f: ConfigFields, model_type: str, conv_dtype: str, ssm_dtype: str) -> tuple[StateTensorSpec, ...]:
    if model_type in _PURE_MAMBA and f.has("intermediate_size"):
        intermediate = f.int("intermediate_size")  # (Jamba's intermediate_size is its MLP's)
    else:
        intermediate = f.int(*_EXPAND) * f.int(*_HIDDEN)
    state = f.int(*_names(("mamba_d_state", "ssm_state_size"), "state_size", model_type))
    conv = _conv("conv", intermediate, f.int(*_CONV_KERNEL, minimum=2), conv_dtype)
    return conv, StateTensorSpec(name="ssm", shape=(intermediate, state), dtype=ssm_dtype)


def _gated_delta_net(f: ConfigFields, _: str, conv_dtype: str, ssm_dtype: str) -> tuple[StateTensorSpec, ...]:
    k_heads, v_heads = f.int("linear_num_key_heads"), f.int("linear_num_value_heads")
    k_dim, v_dim = f.int("linear_key_head_dim"), f.int("linear_value_head_dim")
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim  # q, k and v all pass the conv
    conv = _conv("conv", conv_dim, f.int("linear_conv_kernel_dim", minimum=2), conv_dtype)
    return conv, StateTensorSpec(name="ssm", shape=(v_heads, k_dim, v_dim), dtype=ssm_dtype)


def _kda(f: ConfigFields, _: str, conv_dtype: str, ssm_dtype: str) -> tuple[StateTensorSpec, ...]:
    # The Hub config nests the KDA fields in linear_attn_config; transformers also reads them flat.
    nested = f.sub("linear_attn_config") if f.has("linear_attn_config") else None

    def read(inner: str, outer: str, minimum: int = 1) -> int:
        if nested is not None and nested.has(inner):
            return nested.int(inner, minimum=minimum)
        return f.int(outer, minimum=minimum)

    heads, head_dim = read("num_heads", "linear_num_heads"), read("head_dim", "linear_head_dim")
    kernel = read("short_conv_kernel_size", "linear_conv_kernel_dim", minimum=2)
    convs = tuple(_conv(f"conv_{x}", heads * head_dim, kernel, conv_dtype) for x in "qkv")
    return *convs, StateTensorSpec(name="recurrent", shape=(heads, head_dim, head_dim), dtype=ssm_dtype)


def _short_conv(f: ConfigFields, _: str, conv_dtype: str, ssm_dtype: str) -> tuple[StateTensorSpec, ...]:
    # LFM2: a depthwise conv of width conv_L_cache over hidden_size channels; no SSM state.
    return (_conv("conv", f.int(*_HIDDEN), f.int("conv_L_cache", minimum=2), conv_dtype),)


STATE_SHAPES: dict[str, Callable[[ConfigFields, str, str, str], tuple[StateTensorSpec, ...]]] = {
    "mamba2": _mamba2,
    "mamba1": _mamba1,
    "gated_delta_net": _gated_delta_net,
    "kda": _kda,
    "short_conv": _short_conv,
}
# For model types outside the family table: the first family whose fields the config has.
_FAMILY_FIELDS = (
    ("kda", ("linear_attn_config", "linear_num_heads")),
    ("gated_delta_net", ("linear_num_value_heads", "linear_num_key_heads")),
    ("short_conv", ("conv_L_cache",)),
    ("mamba2", _M2_HEADS),
    ("mamba1", ("mamba_d_state", "mamba_expand")),
)


def recurrent_state(f: ConfigFields, model_type: str, conv_dtype: str, ssm_dtype: str) -> MambaSpec:
    """The state one recurrent layer keeps, read from its family's own fields."""
    family = FAMILIES.get(model_type, (None,))[0]
    family = family or next((name for name, fields in _FAMILY_FIELDS if f.has(*fields)), None)
    if family is None:
        looked = ", ".join(n for _, names in _FAMILY_FIELDS for n in names)
        raise f.error(
            f"layers of model type {model_type!r} keep a recurrent state, but the config names no known "
            f"state family (looked for {looked})"
        )
    return MambaSpec(family=family, tensors=STATE_SHAPES[family](f, model_type, conv_dtype, ssm_dtype))
