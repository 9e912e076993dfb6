"""Recurrent state shapes of Mamba-like layers, read from each family's own config fields.

Shapes follow SGLang/vLLM's state caches at tensor-parallel size 1; a conv state is
(channels, kernel - 1): the last kernel - 1 inputs of every channel. Beside each shape goes its
shard rule (`shard_rule.py`), from the same fields: how the engines split that tensor under TP.
"""

from __future__ import annotations

from collections.abc import Callable

from distpool.model.hf_families import FAMILIES
from distpool.model.hf_fields import ConfigFields
from distpool.model.shard_rule import Segment, ShardRule
from distpool.model.spec import MambaSpec, StateTensorSpec

# One state tensor and how TP splits it (along axis 0: channels, or heads).
_State = tuple[StateTensorSpec, ShardRule]

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


def _conv(name: str, kernel: int, dtype: str, *segments: Segment) -> _State:
    """A conv state over the channels of `segments`, end to end."""
    rule = ShardRule(axis=0, segments=segments)
    return StateTensorSpec(name=name, shape=(rule.axis_length, kernel - 1), dtype=dtype), rule


def _by_rows(name: str, shape: tuple[int, ...], dtype: str, unit: str, segment: str = "heads") -> _State:
    """A state split along its first dim: one `unit` (a head, or a channel) per row."""
    rule = ShardRule(axis=0, segments=(Segment(segment, unit, shape[0], 1),))
    return StateTensorSpec(name=name, shape=shape, dtype=dtype), rule


def _mamba2(f: ConfigFields, model_type: str, conv_dtype: str, ssm_dtype: str) -> tuple[_State, ...]:
    heads = f.int(*_names(_M2_HEADS, "num_heads", model_type))
    head_dim_names = _names(_M2_HEAD_DIM, "head_dim", model_type)
    d_ssm = f.int("mamba_d_ssm", default=None)
    found = f.find(*head_dim_names)
    if found is None or found[1] == "auto":
        # Bamba, Granite-4.0-H, Falcon-H1, Zamba2: the heads split the intermediate size, which is
        # mamba_d_ssm (Falcon-H1) or mamba_expand * hidden_size.
        intermediate = d_ssm or f.int(*_EXPAND) * f.int(*_HIDDEN)
        if intermediate % heads:
            message = f"the Mamba intermediate size {intermediate} does not split into {heads} heads"
            raise f.error(
                "mamba_d_ssm" if d_ssm else _EXPAND[0], intermediate, f"a multiple of {heads}", message
            )
        head_dim = intermediate // heads
    else:
        head_dim = f.int(*head_dim_names)
    if d_ssm is not None and d_ssm != heads * head_dim:
        message = f"mamba_d_ssm ({d_ssm}) must equal Mamba heads x head dim ({heads} x {head_dim})"
        raise f.error("mamba_d_ssm", d_ssm, f"{heads * head_dim} ({heads} x {head_dim})", message)
    state, groups = f.int(*_names(_M2_STATE, "state_size", model_type)), f.int(*_M2_GROUPS)
    # x, B and C all pass the conv: conv_dim = heads * head_dim + 2 * n_groups * state
    x = Segment("x", "Mamba heads", heads, head_dim)
    b, c = (Segment(name, "groups", groups, state, replicable=True) for name in "BC")
    conv = _conv("conv", f.int(*_CONV_KERNEL, minimum=2), conv_dtype, x, b, c)
    return conv, _by_rows("ssm", (heads, head_dim, state), ssm_dtype, "Mamba heads")


def _mamba1(f: ConfigFields, model_type: str, conv_dtype: str, ssm_dtype: str) -> tuple[_State, ...]:
    if model_type in _PURE_MAMBA and f.has("intermediate_size"):
        intermediate = f.int("intermediate_size")  # (Jamba's intermediate_size is its MLP's)
    else:
        intermediate = f.int(*_EXPAND) * f.int(*_HIDDEN)
    state = f.int(*_names(("mamba_d_state", "ssm_state_size"), "state_size", model_type))
    channels = Segment("channels", "Mamba channels", intermediate, 1)
    conv = _conv("conv", f.int(*_CONV_KERNEL, minimum=2), conv_dtype, channels)
    return conv, _by_rows("ssm", (intermediate, state), ssm_dtype, "Mamba channels", "channels")


def _gated_delta_net(f: ConfigFields, _: str, conv_dtype: str, ssm_dtype: str) -> tuple[_State, ...]:
    k_heads, v_heads = f.int("linear_num_key_heads"), f.int("linear_num_value_heads")
    k_dim, v_dim = f.int("linear_key_head_dim"), f.int("linear_value_head_dim")
    # q, k and v all pass the conv: conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    q, k = (Segment(name, "key heads", k_heads, k_dim) for name in "qk")
    v = Segment("v", "value heads", v_heads, v_dim)
    conv = _conv("conv", f.int("linear_conv_kernel_dim", minimum=2), conv_dtype, q, k, v)
    return conv, _by_rows("ssm", (v_heads, k_dim, v_dim), ssm_dtype, "value heads")


def _kda(f: ConfigFields, _: str, conv_dtype: str, ssm_dtype: str) -> tuple[_State, ...]:
    # The Hub config nests the KDA fields in linear_attn_config; transformers also reads them flat.
    nested = f.sub("linear_attn_config") if f.has("linear_attn_config") else None

    def read(inner: str, outer: str, minimum: int = 1) -> int:
        if nested is not None and nested.has(inner):
            return nested.int(inner, minimum=minimum)
        return f.int(outer, minimum=minimum)

    heads, head_dim = read("num_heads", "linear_num_heads"), read("head_dim", "linear_head_dim")
    kernel = read("short_conv_kernel_size", "linear_conv_kernel_dim", minimum=2)
    convs = tuple(
        _conv(f"conv_{x}", kernel, conv_dtype, Segment("heads", "KDA heads", heads, head_dim)) for x in "qkv"
    )
    return *convs, _by_rows("recurrent", (heads, head_dim, head_dim), ssm_dtype, "KDA heads")


def _short_conv(f: ConfigFields, _: str, conv_dtype: str, ssm_dtype: str) -> tuple[_State, ...]:
    # LFM2: a depthwise conv of width conv_L_cache over hidden_size channels; no SSM state.
    channels = Segment("channels", "conv channels", f.int(*_HIDDEN), 1)
    return (_conv("conv", f.int("conv_L_cache", minimum=2), conv_dtype, channels),)


STATE_SHAPES: dict[str, Callable[[ConfigFields, str, str, str], tuple[_State, ...]]] = {
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
        message = (
            f"layers of model type {model_type!r} keep a recurrent state, but the config names no known "
            f"state family (looked for {looked})"
        )
        raise f.error(None, model_type, f"a state family's fields ({looked})", message)
    states = STATE_SHAPES[family](f, model_type, conv_dtype, ssm_dtype)
    return MambaSpec(
        family=family, tensors=tuple(t for t, _ in states), shard_rules=tuple(r for _, r in states)
    )
