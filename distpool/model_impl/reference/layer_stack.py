"""The reference model's layer stack: which layer kind each model layer is, built from the spec."""

from __future__ import annotations

from distpool.model.dtypes import torch_dtype
from distpool.model_impl.reference.attention import AttentionLayer
from distpool.model_impl.reference.layers import WeightFactory
from distpool.model_impl.reference.mamba2 import TIME_STEP_MAX, TIME_STEP_MIN, Mamba2Layer
from distpool.model_impl.reference.mlp import MlpLayer
from distpool.model_impl.reference.tensor_parallel import TPRank

Layer = AttentionLayer | Mamba2Layer | MlpLayer


def build_layers(tp: TPRank, weights: WeightFactory) -> list[Layer]:
    """One layer per model layer, in order: attention for the spec's full-attention layers, Mamba2
    for its Mamba layers, an MLP for every other layer, each the rank's slice of the full layer.
    Full sizes come from the unsharded spec (`tp.shard.model`), the rank's from its shard."""
    spec = tp.shard.model
    attention, mamba = spec.needs_full_attention(), spec.needs_mamba()
    conv, ssm = (t for t in mamba.tensors)  # conv (conv_dim, kernel - 1), ssm (heads, head_dim, state)
    heads, head_dim, state_size = ssm.shape
    n_groups = (conv.shape[0] - heads * head_dim) // (2 * state_size)
    layers: list[Layer] = []
    for index in range(spec.num_layers):
        if index in spec.full_attention_layers:
            layer: Layer = AttentionLayer(
                weights,
                hidden_size=spec.hidden_size,
                num_heads=spec.num_attention_heads,
                num_kv_heads=attention.num_kv_heads,
                head_dim=attention.head_dim,
                kv_dtype=torch_dtype(attention.dtype),
                tp=tp,
            )
        elif index in spec.mamba_layers:
            layer = Mamba2Layer(
                weights,
                hidden_size=spec.hidden_size,
                num_heads=heads,
                head_dim=head_dim,
                state_size=state_size,
                n_groups=n_groups,
                conv_kernel=conv.shape[1] + 1,
                eps=spec.norm_eps,
                time_step_min=TIME_STEP_MIN,
                time_step_max=TIME_STEP_MAX,
                conv_dtype=torch_dtype(conv.dtype),
                ssm_dtype=torch_dtype(ssm.dtype),
                tp=tp,
                state_names=(conv.name, ssm.name),
            )
        else:
            layer = MlpLayer(
                weights, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, tp=tp
            )
        layers.append(layer)
    return layers
