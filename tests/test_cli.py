"""`distpool check`: exit codes, the JSON figures, and errors without tracebacks."""

import json
import subprocess
import sys

import pytest

from distpool.cli import main
from tests.factories import FIXTURES

GIB = 1 << 30


def check_json(capsys, *args: str) -> dict:
    assert main(["check", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_every_documented_field_for_a_hybrid_mamba_model(capsys):
    out = check_json(
        capsys, str(FIXTURES / "qwen3_next.json"), "--enable-unified-memory", "--memory-gib", "4"
    )
    assert out["model_kind"] == "hybrid_mamba"
    assert out["architectures"] == ["Qwen3NextForCausalLM"]
    assert (out["num_full_attention_layers"], out["num_mamba_layers"], out["num_swa_layers"]) == (12, 36, 0)
    assert out["unified"] is True
    # 12 layers x 16 tokens x 2 KV heads x (256 K + 256 V) x 2 bytes
    assert out["page_bytes"] == 12 * 16 * 2 * (256 + 256) * 2
    # per GDN layer: conv (2*16*128 + 32*128) x 3 bf16 + state 32 x 128 x 128 fp32
    assert out["slot_bytes"] == 36 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)
    assert out["max_total_tokens"] == out["num_pages"] * 16
    assert out["num_slots"] == out["max_running_requests"] > 0


def test_dense_model_reports_zero_for_what_does_not_apply(capsys):
    out = check_json(capsys, str(FIXTURES / "llama3.json"), "--page-size", "32")
    assert (out["model_kind"], out["slot_bytes"], out["num_slots"], out["num_mamba_layers"]) == (
        "dense",
        0,
        0,
        0,
    )
    assert out["page_bytes"] == 32 * 32 * 2 * 8 * 128 * 2
    assert out["unified"] is False


def test_directory_argument_and_readable_summary(capsys, tmp_path):
    (tmp_path / "config.json").write_text((FIXTURES / "nemotron_h.json").read_text())
    assert main(["check", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "hybrid_mamba" in text and "requests at full context" in text and "slot" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["llama3.json", "--enable-unified-memory"], "not hybrid"),
        (["deepseek_v4.json", "--enable-unified-memory"], "DeepSeek-V4"),
        (["gpt_oss.json", "--enable-unified-memory", "--disaggregation-mode", "decode"], "without PD"),
        (["nemotron_h.json", "--memory-gib", "0.01"], "--memory-gib"),
        (["missing.json"], "no such file"),
    ],
)
def test_refusals_and_bad_input_exit_2_with_reason_and_no_traceback(args, message):
    argv = [str(FIXTURES / args[0]), *args[1:]]
    proc = subprocess.run([sys.executable, "-m", "distpool", "check", *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_invalid_json_and_unknown_architecture(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert main(["check", str(bad)]) == 2
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"architectures": ["Mystery"], "foo": 1}))
    assert main(["check", str(odd)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "unknown architecture Mystery" in err


def test_unified_hybrid_swa_is_allowed_colocated(capsys):
    out = check_json(capsys, str(FIXTURES / "gpt_oss.json"), "--enable-unified-memory")
    assert out["model_kind"] == "hybrid_swa" and out["unified"] is True and out["num_swa_layers"] > 0


@pytest.mark.parametrize(
    "alias, canonical", [("bf16", "bfloat16"), ("fp32", "float32"), ("fp8_e4m3", "float8_e4m3fn")]
)
def test_dtype_aliases_work_on_the_command_line_as_in_python(capsys, alias, canonical):
    by_alias = check_json(capsys, str(FIXTURES / "llama3.json"), "--kv-dtype", alias)
    by_name = check_json(capsys, str(FIXTURES / "llama3.json"), "--kv-dtype", canonical)
    assert by_alias == by_name


@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "0", "-1", "lots"])
def test_a_budget_that_is_not_a_finite_positive_size_is_refused_naming_the_flag(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", str(FIXTURES / "llama3.json"), "--memory-gib", value])
    assert exit_info.value.code == 2 and "--memory-gib" in capsys.readouterr().err


def test_a_bad_transfer_timeout_is_refused_before_ray_starts(capsys):
    assert main(["run", "--transfer-timeout", "0"]) == 2
    assert "transfer timeout must be 0.1 to 3600" in capsys.readouterr().err
