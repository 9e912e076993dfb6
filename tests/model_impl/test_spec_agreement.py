"""Our sizes held against transformers' own code, layer by layer.

For every preset and public config of the six architectures the transformers runner serves, and the
tiny config of each, transformers builds the model on the meta device (no memory, no weights, no
forward pass) and what each layer keeps per request is read from its modules' attributes
(`layout.module_tensors`): K and V of a token, the conv and recurrent state. It is compared with the
`ModelSpec` like with like:

- transformers' convention: `in_transformers_convention(spec_from_hf(config), dtype)` names exactly
  the modules' tensors (shapes, dtypes, KV heads, head dims), and is what the runner's pools are
  sized with (`runner_spec`);
- the engine convention (`spec_from_hf`, what `check` and the presets say), at the model's own dtype:
  the same tensors, but a conv state of kernel - 1 columns.

A field a config leaves out means transformers' default in both (or our reader refuses the config),
and the tiny models' real allocation through transformers' `DynamicCache` is the convention's.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoConfig, AutoModelForCausalLM

from distpool.model.convention import in_transformers_convention
from distpool.model.dtypes import torch_dtype
from distpool.model.hf_config import spec_from_hf
from distpool.model.hf_families import FAMILIES
from distpool.model.presets import PRESETS_DIR, preset_names, preset_rows
from distpool.model.spec import ENGINE_CONVENTION, TRANSFORMERS_CONVENTION, ModelSpec, StateTensorSpec
from distpool.model_impl.hf.layout import check_allocation, module_tensors, runner_spec
from distpool.model_impl.hf.support import architecture_of
from distpool.model_impl.hf.tiny import TINY_CONFIGS, tiny_config
from distpool.model_impl.hf.transformers_internals import cache_argument
from tests.factories import FIXTURES

Layers = list[tuple[StateTensorSpec, ...]]


def _served(data: dict) -> bool:
    return architecture_of(spec_from_hf(data)) is not None


def _configs() -> dict[str, dict]:
    """Every preset and public test config of the runner's architectures, and the tiny ones."""
    public = {name: json.loads((PRESETS_DIR / f"{name}.json").read_text()) for name in preset_names()}
    public |= {f"public {p.stem}": json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json"))}
    tiny = {f"tiny {model_type}": tiny_config(model_type) for model_type in TINY_CONFIGS}
    return {name: data for name, data in public.items() if _served(data)} | tiny


CONFIGS = _configs()
# What `distpool presets` (and the README) says the transformers runner keeps, by dtype.
RUNNER_SLOT_BYTES = {
    (row.name, dtype): nbytes
    for row in preset_rows()
    for dtype, nbytes in (
        ("bfloat16", row.transformers_slot_bytes),
        ("float32", row.transformers_slot_bytes_float32),
    )
}


def meta_model(data: dict, dtype: str):
    """transformers' model of the config `data`, computing in `dtype`, on the meta device."""
    config = AutoConfig.for_model(**data)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))


def modules_of(data: dict, dtype: str, model=None) -> Layers:
    """What each layer of transformers' model keeps (its architecture's state family, whatever the
    spec says)."""
    model = meta_model(data, dtype) if model is None else model
    return module_tensors(model, FAMILIES[data["model_type"]][0])


def differences(spec: ModelSpec, found: Layers) -> list[str]:
    """Every layer whose tensors in `spec` are not the modules' `found` ones."""
    out = [] if len(found) == spec.num_layers else [f"{spec.num_layers} layers, modules {len(found)}"]
    for layer, theirs in enumerate(found):
        if spec.layer_tensors(layer) != theirs:
            out.append(f"layer {layer}: the spec keeps {spec.layer_tensors(layer)}, the modules {theirs}")
    return out


def engine_columns(found: Layers) -> Layers:
    """The modules' tensors with a conv state of kernel - 1 columns, as the engines keep it."""
    return [
        tuple(
            dataclasses.replace(t, shape=(t.shape[0], t.shape[1] - 1)) if t.name == "conv" else t
            for t in layer
        )
        for layer in found
    ]


def test_the_configs_cover_every_served_architecture_and_every_preset():
    architectures = {architecture_of(spec_from_hf(data)).name for data in CONFIGS.values()}
    assert len(architectures) == 6
    assert set(preset_names()) <= set(CONFIGS)  # every preset is of one of the six


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_layer_keeps_what_the_spec_says_in_either_convention(name):
    data = CONFIGS[name]
    engine = spec_from_hf(data)
    assert engine.state_convention == ENGINE_CONVENTION
    for dtype in sorted({engine.dtype, "float32"}):  # float32: what a CPU runs a bf16 checkpoint in
        model = meta_model(data, dtype)
        found = modules_of(data, dtype, model)
        if dtype == engine.dtype:  # the model's own dtype: bfloat16 unless its config says
            assert differences(engine, engine_columns(found)) == []
        theirs = in_transformers_convention(engine, dtype)
        assert theirs.state_convention == TRANSFORMERS_CONVENTION
        assert differences(theirs, found) == []
        if engine.mamba is not None:  # (the runner serves hybrids only)
            sized = runner_spec(model, engine, dtype)
            assert sized.layout_fields() == theirs.layout_fields()
            assert sized.state_convention == TRANSFORMERS_CONVENTION
            assert RUNNER_SLOT_BYTES.get((name, dtype), sized.slot_bytes) == sized.slot_bytes


@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
def test_a_field_left_out_means_transformers_default_or_is_refused(model_type):
    """Regression: left out, num_key_value_heads is 8 in transformers (2 for Qwen3-Next), not one
    per query head; head_dim is 128 for Nemotron-H and 256 for Qwen3-Next, not hidden / heads;
    Jamba's attn_layer_period is 8, not "every layer attention"."""
    full = tiny_config(model_type)
    compared, wrong = 0, {}
    for field in full.keys() - {"model_type"}:
        data = {k: v for k, v in full.items() if k != field}
        try:
            spec = spec_from_hf(data)
        except ValueError:
            continue  # refused, with the field named: never a wrong size
        try:
            found = modules_of(data, "float32")
        except (ValueError, TypeError, StrictDataclassClassValidationError):  # nor can transformers
            continue
        if found_differences := differences(in_transformers_convention(spec, "float32"), found):
            wrong[field] = found_differences
        compared += 1
    assert wrong == {}
    assert compared >= len(full) // 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
def test_transformers_allocates_what_its_convention_says(model_type, dtype):
    """Two real tokens through transformers' own `DynamicCache` (the load-time check)."""
    config = AutoConfig.for_model(**tiny_config(model_type))
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype)).eval()
    spec = in_transformers_convention(spec_from_hf(tiny_config(model_type)), dtype)
    check_allocation(model, spec, cache_argument=cache_argument(model))
