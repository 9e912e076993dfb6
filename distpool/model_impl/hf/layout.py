"""The runner's KV and state tensors, read from the model's own modules, and held against what
transformers allocates.

The pool of a transformers run is sized with `runner_spec`: per attention module its KV heads and head
dims, per recurrent mixer its conv state `(conv channels, conv_kernel_size)` and its recurrent state
(Mamba2 `(heads, head_dim, state)`, gated delta net `(value heads, key dim, value dim)`, Mamba1
`(channels, state)`). K, V and the conv state are in the dtype of the module's weights (the compute
dtype); the recurrent state in the dtype transformers' scans produce it in
(`distpool.model.convention`). This is transformers' convention (a conv state of `kernel` columns),
not the engine convention `hf_state` follows (`kernel - 1` columns).
Read from attributes only, so a meta-device model (no memory, no weights) sizes the pools before Ray
starts. `check_allocation` runs one short forward through transformers' own `DynamicCache` at load and
refuses a model whose tensors differ, naming both shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from distpool.model.convention import recurrent_dtype
from distpool.model.dtypes import canonical_dtype
from distpool.model.spec import (
    TRANSFORMERS_CONVENTION,
    AttentionSpec,
    MambaSpec,
    ModelSpec,
    StateTensorSpec,
)
from distpool.model_impl.errors import LayoutDifference, LayoutMismatch
from distpool.model_impl.hf.checkpoint import check_checkpoint
from distpool.model_impl.hf.loader import empty_model, weight_bytes
from distpool.model_impl.hf.source import HFSource
from distpool.model_impl.hf.transformers_internals import layer_keys, layer_states, weight_forms

# The recurrent state's shape per state family (hf_families' names), from the mixer's attributes.
_RECURRENT_SHAPE: dict[str, Callable[[nn.Module], tuple[int, ...]]] = {
    "mamba2": lambda m: (m.num_heads, m.head_dim, m.ssm_state_size),
    "gated_delta_net": lambda m: (m.num_v_heads, m.head_k_dim, m.head_v_dim),
    "mamba1": lambda m: (m.intermediate_size, m.ssm_state_size),
}


def layer_modules(model: PreTrainedModel) -> list[tuple[nn.Module | None, nn.Module | None]]:
    """(attention module, recurrent mixer) of every decoder layer; None where the layer has none."""
    out = []
    for index, layer in enumerate(model.get_decoder().layers):
        attention = mixer = None
        for module in layer.modules():
            if isinstance(getattr(module, "conv1d", None), nn.Conv1d):
                mixer = module
            elif hasattr(module, "k_proj") and hasattr(module, "v_proj"):
                attention = module
        for module in (attention, mixer):
            if module is not None and module.layer_idx != index:
                raise ValueError(
                    f"decoder layer {index} holds a {type(module).__name__} of layer {module.layer_idx}"
                )
        out.append((attention, mixer))
    return out


def _dtype_of(module: nn.Module) -> str:
    return str(module.weight.dtype).removeprefix("torch.")


def _attention_spec(module: nn.Module) -> AttentionSpec:
    head_dim = module.head_dim
    return AttentionSpec(
        num_kv_heads=module.k_proj.out_features // head_dim,
        head_dim=head_dim,
        v_head_dim=module.v_proj.out_features // (module.k_proj.out_features // head_dim),
        dtype=_dtype_of(module.k_proj),
    )


def _state_spec(mixer: nn.Module, family: str) -> MambaSpec:
    compute = _dtype_of(mixer.conv1d)
    conv = StateTensorSpec(
        name="conv", shape=(mixer.conv1d.in_channels, mixer.conv_kernel_size), dtype=compute
    )
    shape = tuple(_RECURRENT_SHAPE[family](mixer))
    recurrent = StateTensorSpec(name="ssm", shape=shape, dtype=recurrent_dtype(family, compute))
    return MambaSpec(family=family, tensors=(conv, recurrent))


def module_tensors(model: PreTrainedModel, family: str | None) -> list[tuple[StateTensorSpec, ...]]:
    """Per decoder layer, what its modules keep per request, as `ModelSpec.layer_tensors` lists it:
    K and V of one token, then the conv and recurrent state of a `family` mixer (None: a model
    without recurrent layers)."""
    out = []
    for attention, mixer in layer_modules(model):
        tensors: list[StateTensorSpec] = []
        if attention is not None:
            kv = _attention_spec(attention)
            tensors += [
                StateTensorSpec("k", (kv.num_kv_heads, kv.head_dim), kv.dtype),
                StateTensorSpec("v", (kv.num_kv_heads, kv.v_head_dim), kv.dtype),
            ]
        if mixer is not None:
            if family is None:
                raise ValueError(
                    f"{type(mixer).__name__} is a recurrent mixer in a model without a state family"
                )
            tensors += _state_spec(mixer, family).tensors
        out.append(tuple(tensors))
    return out


def _one(values: list, what: str, source: str):
    """The value every layer agrees on; a ValueError naming the layers that differ."""
    distinct = {v for _, v in values}
    if len(distinct) > 1:
        raise ValueError(f"{source}: layers differ in their {what} ({values}); the pool needs one per kind")
    return distinct.pop() if distinct else None


def runner_spec(model: PreTrainedModel, base: ModelSpec, dtype: str) -> ModelSpec:
    """`base` (the config's classification) with the layers, KV and state the model's modules keep
    in `dtype`. Raises ValueError when the modules disagree with the config's layer kinds."""
    dtype = canonical_dtype(dtype)
    if base.mamba is None or base.mamba.family not in _RECURRENT_SHAPE:
        family = base.mamba.family if base.mamba else "none"
        raise ValueError(
            f"{base.source}: the transformers runner keeps {sorted(_RECURRENT_SHAPE)} state; got {family}"
        )
    modules = layer_modules(model)
    attention_layers = tuple(i for i, (a, _) in enumerate(modules) if a is not None)
    mamba_layers = tuple(i for i, (_, m) in enumerate(modules) if m is not None)
    if (attention_layers, mamba_layers) != (base.full_attention_layers, base.mamba_layers):
        raise ValueError(
            f"{base.source}: the model's modules put attention in layers {list(attention_layers)} and "
            f"recurrent mixers in {list(mamba_layers)}; the config says {list(base.full_attention_layers)} "
            f"and {list(base.mamba_layers)}"
        )
    attention = _one([(i, _attention_spec(a)) for i, (a, _) in enumerate(modules) if a], "KV", base.source)
    state = _one(
        [(i, _state_spec(m, base.mamba.family)) for i, (_, m) in enumerate(modules) if m],
        "recurrent state",
        base.source,
    )
    for what, found in (("KV", attention.dtype), ("conv state", state.tensors[0].dtype)):
        if found != dtype:
            raise ValueError(f"{base.source}: the model computes its {what} in {found}, not {dtype}")
    return dataclasses.replace(
        base, full_attention=attention, mamba=state, dtype=dtype, state_convention=TRANSFORMERS_CONVENTION
    )


def _shape(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape[1:])} {str(tensor.dtype).removeprefix('torch.')}"


def check_allocation(model: PreTrainedModel, spec: ModelSpec, *, cache_argument: str) -> None:
    """Run two tokens through transformers' own `DynamicCache` and compare, per layer, the tensors it
    allocated (per request) with the pool's; LayoutMismatch naming both shapes on any difference."""
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    with torch.no_grad():
        model(
            input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
            use_cache=True,
            **{cache_argument: cache},
        )
    problems: list[LayoutDifference] = []
    for index in range(len(cache.layers)):
        if index in spec.mamba_layers:
            conv, recurrent = spec.needs_mamba().tensors
            for ours, theirs in zip((conv, recurrent), layer_states(cache, index), strict=True):
                mine = f"{ours.shape} {ours.dtype}"
                if theirs is None or _shape(theirs) != mine:
                    got = "nothing" if theirs is None else _shape(theirs)
                    problems.append(LayoutDifference(index, ours.name, mine, got))
        if index in spec.full_attention_layers:
            kv = spec.needs_full_attention()
            keys = layer_keys(cache, index)  # (1, kv_heads, 2, head_dim)
            mine = f"({kv.num_kv_heads}, {kv.head_dim}) {kv.dtype}"
            got = f"({keys.shape[1]}, {keys.shape[3]}) {str(keys.dtype).removeprefix('torch.')}"
            if mine != got:
                problems.append(LayoutDifference(index, "K per token", mine, got))
    if problems:
        raise LayoutMismatch(spec.source, problems)


def sized_spec(source: HFSource, base: ModelSpec) -> tuple[ModelSpec, int]:
    """What the pools of a run of `source` are sized with (`runner_spec` of its modules, built on
    the meta device) and the bytes of one copy of its weights; a checkpoint the modules cannot
    load is refused (`check_checkpoint`: CheckpointError)."""
    model = empty_model(source)
    if source.load_format == "safetensors":  # refused here, not in every worker after Ray started
        check_checkpoint(Path(source.path), weight_forms(model))
    return runner_spec(model, base, source.dtype), weight_bytes(model)
