"""Model presets: every bundled public config classifies as hybrid, with the state sizes worked out by hand.

Slot bytes per Mamba2 layer = conv (heads x head_dim + 2 x groups x state, kernel - 1) in the model
dtype + ssm (heads, head_dim, state) in the SSM dtype.
"""

import importlib.resources
import json

import pytest

from distpool.model.hf_config import spec_from_hf
from distpool.model.presets import PRESETS_DIR, preset_names, preset_rows, resolve_model
from distpool.model.spec import HYBRID_MAMBA
from tests.factories import FIXTURES

MIB = 1 << 20
PRESETS = (
    "falcon-h1-7b",
    "granite-4.0-h-small",
    "jamba-v0.1",
    "nemotron-h-56b",
    "nemotron-h-8b",
    "nemotron-nano-9b-v2",
    "qwen3-next-80b-a3b",
)


def preset_spec(name: str, **overrides: str | None):
    return spec_from_hf(resolve_model(name), **overrides)


def test_the_bundled_presets_are_listed_sorted():
    assert preset_names() == list(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_a_hybrid_mamba_model_with_attention_and_state(name):
    spec = preset_spec(name)
    assert spec.kind == HYBRID_MAMBA
    assert spec.num_full_attention_layers > 0 and spec.num_mamba_layers > 0
    assert spec.full_kv_bytes_per_token > 0 and spec.slot_bytes > 0
    assert spec.vocab_size > 0 and spec.dtype == "bfloat16"


def test_nemotron_h_8b_keeps_24_mamba_and_4_attention_layers_and_a_50_mib_bf16_slot():
    spec = preset_spec("nemotron-h-8b", ssm_dtype="bf16")
    assert (spec.num_layers, spec.num_mamba_layers, spec.num_full_attention_layers) == (52, 24, 4)
    assert spec.full_attention_layers == (7, 18, 29, 40)
    per_layer = (128 * 64 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 2
    assert spec.slot_bytes == 24 * per_layer == 51_806_208
    assert 45 * MIB < spec.slot_bytes < 55 * MIB
    assert spec.full_kv_bytes_per_token == 4 * 8 * (128 + 128) * 2
    # The config states no SSM dtype: the state is float32 by default, twice the ssm tensor.
    assert preset_spec("nemotron-h-8b").slot_bytes == 24 * (
        (128 * 64 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4
    )


def test_nemotron_h_56b_keeps_54_mamba_and_10_attention_layers_and_a_slot_of_hundreds_of_mib():
    spec = preset_spec("nemotron-h-56b", ssm_dtype="bf16")
    assert (spec.num_layers, spec.num_mamba_layers, spec.num_full_attention_layers) == (118, 54, 10)
    assert spec.slot_bytes == 54 * ((256 * 64 + 2 * 8 * 256) * 3 * 2 + 256 * 64 * 256 * 2)
    assert 400 * MIB < spec.slot_bytes < 500 * MIB  # 438.6 MiB; 870 MiB with a float32 state
    assert spec.full_kv_bytes_per_token == 10 * 8 * (128 + 128) * 2


@pytest.mark.parametrize(
    "preset, fixture",
    [
        ("nemotron-nano-9b-v2", "nemotron_h"),
        ("qwen3-next-80b-a3b", "qwen3_next"),
        ("falcon-h1-7b", "falcon_h1"),
        ("granite-4.0-h-small", "granite_4_h"),
        ("jamba-v0.1", "jamba"),
    ],
)
def test_presets_copied_from_the_test_fixtures_classify_the_same(preset, fixture):
    assert preset_spec(preset).layout_fields() == spec_from_hf(FIXTURES / f"{fixture}.json").layout_fields()


def test_preset_rows_carry_the_spec_figures():
    rows = {r.name: r for r in preset_rows()}
    assert list(rows) == list(PRESETS)
    row = rows["nemotron-h-8b"]
    assert (row.architecture, row.kind, row.num_attention_layers, row.num_mamba_layers) == (
        "NemotronHForCausalLM",
        HYBRID_MAMBA,
        4,
        24,
    )
    assert (row.slot_bytes, row.kv_bytes_per_token) == (preset_spec("nemotron-h-8b").slot_bytes, 16384)
    assert (row.kv_dtype, row.ssm_dtype) == ("bfloat16", "float32")
    falcon = rows["falcon-h1-7b"]  # parallel hybrid: every layer has attention and a state
    assert (falcon.num_attention_layers, falcon.num_mamba_layers) == (44, 44)


def test_resolve_model_takes_a_preset_a_file_or_a_directory(tmp_path):
    assert resolve_model("jamba-v0.1") == PRESETS_DIR / "jamba-v0.1.json"
    config = tmp_path / "config.json"
    config.write_text((FIXTURES / "llama3.json").read_text())
    assert resolve_model(str(config)) == config
    assert resolve_model(str(tmp_path)) == config


@pytest.mark.parametrize("given, reason", [("nemotron-h-9b", "no such file"), ("", "no config.json")])
def test_resolve_model_names_the_input_and_every_preset(given, reason, tmp_path):
    given = given or str(tmp_path)  # "": an existing directory without a config.json
    with pytest.raises(ValueError) as info:
        resolve_model(given)
    message = str(info.value)
    assert message.startswith(f"{given}: {reason}")
    assert all(name in message for name in PRESETS) and "\n" not in message


def test_preset_files_ship_inside_the_package():
    shipped = importlib.resources.files("distpool.model.presets")
    for name in PRESETS:
        resource = shipped / f"{name}.json"
        assert resource.is_file()
        assert json.loads(resource.read_text())["architectures"]
