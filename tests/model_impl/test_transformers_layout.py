"""What the transformers runner's pools hold and where its weights come from: tensors read from the
model's modules (transformers' convention), held against what transformers allocates at load; real,
sharded and seeded dummy weights; the architectures it refuses."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from distpool.model.convention import RECURRENT_DTYPE
from distpool.model.hf_config import spec_from_hf
from distpool.model.spec import StateTensorSpec
from distpool.model_impl.errors import (
    ImplCannotRun,
    LayoutDifference,
    LayoutMismatch,
    NoWeights,
    PoolsSizedOtherwise,
)
from distpool.model_impl.hf.layout import _RECURRENT_SHAPE, check_allocation
from distpool.model_impl.hf.loader import load_model
from distpool.model_impl.hf.runner import TransformersRunner
from distpool.model_impl.hf.source import resolve_source
from distpool.model_impl.hf.transformers_internals import cache_argument
from distpool.model_impl.select import choose_model_impl, resolve_implementation
from tests.factories import FIXTURES
from tests.hf_checkpoints import generate, load_for_generate, save_checkpoint
from tests.model_impl.test_transformers_runner import pool_for, tokens


def test_the_pools_hold_what_the_modules_keep_in_transformers_convention(hf_checkpoints):
    config = hf_checkpoints["bamba"] / "config.json"
    impl = resolve_implementation(config, "transformers", dtype="float64")
    engine = spec_from_hf(config)
    # Bamba: 4 heads x 16 dims, 1 group x 8 state dims, a 4-wide conv over x | B | C = 64 + 16 channels.
    assert impl.spec.mamba.tensors == (
        StateTensorSpec(name="conv", shape=(80, 4), dtype="float64"),  # kernel columns, compute dtype
        StateTensorSpec(name="ssm", shape=(4, 16, 8), dtype="float32"),  # as transformers' scan keeps it
    )
    assert engine.mamba.tensors[0].shape == (80, 3)  # the engine convention: kernel - 1 columns
    kv = impl.spec.full_attention
    assert (kv.num_kv_heads, kv.head_dim, kv.v_head_dim, kv.dtype) == (2, 8, 8, "float64")
    assert (impl.spec.full_attention_layers, impl.spec.mamba_layers) == ((1,), (0, 2))
    model = load_model(impl.hf, device="cpu", seed=0, attention="sdpa")
    tensors = [*model.parameters(), *model.buffers()]  # float64 weights, the rotary table's buffer
    assert impl.hf.weight_bytes == sum(t.numel() * t.element_size() for t in tensors) > 8 * 35_000
    # Jamba's Mamba1 scan keeps its state in the compute dtype when that is wider than float32.
    jamba = resolve_implementation(hf_checkpoints["jamba"] / "config.json", "transformers", dtype="float64")
    assert jamba.spec.mamba.tensors[1] == StateTensorSpec(name="ssm", shape=(64, 8), dtype="float64")


def test_a_pool_sized_in_another_convention_is_refused_at_load_naming_both_shapes(hf_checkpoints):
    config = hf_checkpoints["bamba"] / "config.json"
    impl = resolve_implementation(config, "transformers", dtype="float64")
    conv, ssm = impl.spec.mamba.tensors
    narrow = dataclasses.replace(conv, shape=(80, 3))  # what SGLang and vLLM keep
    engine = dataclasses.replace(impl.spec, mamba=dataclasses.replace(impl.spec.mamba, tensors=(narrow, ssm)))
    model = load_model(impl.hf, device="cpu", seed=0, attention="sdpa")
    with pytest.raises(LayoutMismatch) as refused:
        check_allocation(model, engine, cache_argument=cache_argument(model))
    conv_0 = LayoutDifference(layer=0, tensor="conv", pool="(80, 3) float64", transformers="(80, 4) float64")
    assert refused.value.differences[0] == conv_0
    with pytest.raises(PoolsSizedOtherwise) as sized:
        TransformersRunner(engine, impl.hf)
    assert sized.value.sized_state == engine.mamba and sized.value.loaded_state == impl.spec.mamba


def test_a_sharded_checkpoint_loads_through_its_index(tmp_path):
    folder = save_checkpoint("granitemoehybrid", tmp_path / "sharded", seed=4)
    model = load_for_generate(folder)
    model.save_pretrained(folder, max_shard_size="20KB")  # float64 now, in several files
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert (folder / "model.safetensors.index.json").is_file() and len(shards) > 2
    (folder / "model.safetensors").unlink(missing_ok=True)
    impl = resolve_implementation(folder / "config.json", "auto")
    assert (impl.name, impl.hf.load_format, impl.hf.dtype) == ("transformers", "safetensors", "float64")
    runner = TransformersRunner(impl.spec, impl.hf)
    prompt = tokens(11, 8)
    assert runner.generate(pool_for(impl), [prompt], 4) == [generate(model, prompt, 4)]


def test_dummy_weights_come_from_the_config_and_the_seed(hf_checkpoints, tmp_path):
    loose = tmp_path / "bamba-config.json"  # a config file alone: no folder, no weights
    loose.write_text((hf_checkpoints["bamba"] / "config.json").read_text())
    with pytest.raises(NoWeights) as refused:
        resolve_implementation(loose, "transformers")
    assert (refused.value.folder, refused.value.load_format) == (str(loose), "auto")
    impl = resolve_implementation(loose, "transformers", load_format="dummy")
    assert (impl.hf.load_format, impl.hf.dtype) == ("dummy", "float32")

    def weights(seed: int) -> list[torch.Tensor]:
        return list(load_model(impl.hf, device="cpu", seed=seed, attention="sdpa").state_dict().values())

    first, again, other = weights(1), weights(1), weights(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_dtype_auto_is_the_checkpoints_and_float32_for_bfloat16_on_a_cpu(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bamba"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    path = tmp_path / "config.json"
    resolved = {
        (dtype, on_cpu): resolve_source(
            path, load_format="auto", dtype="auto", checkpoint_dtype=dtype, on_cpu=on_cpu
        ).dtype
        for dtype in ("bfloat16", "float16")
        for on_cpu in (True, False)
    }
    assert resolved == {
        ("bfloat16", True): "float32",
        ("bfloat16", False): "bfloat16",
        ("float16", True): "float16",
        ("float16", False): "float16",
    }
    asked = resolve_source(
        path, load_format="auto", dtype="bfloat16", checkpoint_dtype="float32", on_cpu=True
    )
    assert asked.dtype == "bfloat16"


def test_auto_takes_transformers_only_for_weights_of_a_supported_architecture(hf_checkpoints, tmp_path):
    bamba = hf_checkpoints["bamba"] / "config.json"
    assert resolve_implementation(bamba, "auto").name == "transformers"
    assert resolve_implementation(bamba, "auto", auto_transformers=False).name == "reference"
    without_weights = tmp_path / "jamba.json"
    without_weights.write_text((hf_checkpoints["jamba"] / "config.json").read_text())
    assert resolve_implementation(without_weights, "auto").name == "synthetic"  # Mamba1: no reference model


def test_other_architectures_are_refused_with_the_supported_list_and_the_alternative():
    llama = spec_from_hf(FIXTURES / "llama3.json")
    with pytest.raises(ImplCannotRun) as refused:
        choose_model_impl(llama, "transformers")
    assert (refused.value.impl, refused.value.source) == ("transformers", llama.source)
    served = ", ".join(
        f"{name}ForCausalLM"
        for name in ("Bamba", "NemotronH", "Qwen3Next", "FalconH1", "Jamba", "GraniteMoeHybrid")
    )
    assert refused.value.reason == (
        f"{llama.source}: the transformers runner serves {served}; LlamaForCausalLM is not one of them"
    )


def test_every_state_family_has_its_recurrent_shape_and_dtype():
    assert set(_RECURRENT_SHAPE) == set(RECURRENT_DTYPE) == {"mamba2", "gated_delta_net", "mamba1"}
