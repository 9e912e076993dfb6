"""`distpool check`: exit codes, the JSON figures, and errors without tracebacks."""

import json
import subprocess
import sys

import pytest

from distpool.cli import main
from distpool.cli.errors import error_text
from distpool.memory.sizing import BudgetTooSmall, RequestNeeds
from distpool.model.presets import preset_names
from distpool.serving.deploy.deployment_checks import RankPoolRefused, TooFewNodes
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


def test_a_hybrid_config_without_its_layer_schedule_is_refused_with_the_fix(tmp_path, capsys):
    config = json.loads((FIXTURES / "nemotron_h.json").read_text())
    del config["hybrid_override_pattern"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distpool: error: {path}: a nemotron_h model keeps mamba2 state in some layers")
    assert err.endswith(
        ". Fix: add the one its checkpoint's config.json has (e.g. hybrid_override_pattern or layer_types)\n"
    )


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


# ---- presets -----------------------------------------------------------------------------------
def test_check_takes_a_preset_name(capsys):
    out = check_json(capsys, "nemotron-h-8b", "--ssm-dtype", "bf16")
    assert out["architectures"] == ["NemotronHForCausalLM"] and out["model_kind"] == "hybrid_mamba"
    assert (out["num_full_attention_layers"], out["num_mamba_layers"]) == (4, 24)
    assert out["slot_bytes"] == 24 * ((128 * 64 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 2)  # 49.4 MiB
    assert out["page_bytes"] == 16 * 4 * 8 * (128 + 128) * 2


def test_presets_table_names_every_preset_with_its_figures(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["preset", "architecture", "kind", "attention", "mamba"]
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.split()[0] in preset_names()}
    assert sorted(rows) == preset_names()
    # name, architecture, kind, attention, mamba, slot MiB (engine convention), the transformers
    # runner's slot MiB in the checkpoint's dtype (a conv state of kernel columns), KV KiB/token, dtypes
    assert rows["nemotron-h-8b"][1:8] == [
        "NemotronHForCausalLM",
        "hybrid_mamba",
        "4",
        "24",
        "97.41",
        "97.88",
        "16.00",
    ]
    assert rows["nemotron-h-56b"][3:5] == ["10", "54"]


def test_presets_json_lists_every_preset(capsys):
    assert main(["presets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == preset_names()
    assert all(r["kind"] == "hybrid_mamba" and r["slot_bytes"] > 0 for r in rows)


def test_an_unknown_preset_exits_2_naming_the_presets():
    proc = subprocess.run(
        [sys.executable, "-m", "distpool", "check", "nemotron-h-9b"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "nemotron-h-9b" in proc.stderr and all(name in proc.stderr for name in preset_names())


def test_run_refuses_an_unknown_model_before_ray_starts(capsys):
    assert main(["run", "--model", "nemotron-h-9b"]) == 2
    assert "nemotron-h-8b" in capsys.readouterr().err


def test_run_refuses_the_long_workload_when_the_context_cannot_hold_8k_prompts(capsys):
    assert main(["run", "--workload", "long", "--context-len", "4096"]) == 2
    assert "--context-len" in capsys.readouterr().err


def test_run_offers_exactly_the_workloads(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--workload", "huge"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(name in err for name in ("short", "long-tailed", "long", "mixed"))


@pytest.mark.parametrize("command", ["check", "presets", "run"])
def test_every_subcommand_prints_its_help(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: distpool {command}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "expected"), [([], True), (["--no-prefix-cache"], False), (["--prefix-cache"], True)]
)
def test_the_prefix_cache_is_on_by_default_and_the_flag_turns_it_off(flag, expected):
    from distpool.cli import build_parser
    from distpool.cli.flags import pool_args_from

    ns = build_parser().parse_args(["run", *flag])
    assert pool_args_from(ns, None).prefix_cache is expected


UNIFIED_SUPPORTED = (
    "supported: hybrid Mamba / linear-attention models (colocated or PD) and hybrid sliding-window "
    "models (colocated only)"
)


@pytest.mark.parametrize(
    ("fixture", "flags", "printed"),
    [
        (
            "llama3.json",
            ["--enable-unified-memory"],
            "--enable-unified-memory does nothing for LlamaForCausalLM: the model is dense, not hybrid "
            "(it has no second kind of per-request memory to share an arena with); "
            f"{UNIFIED_SUPPORTED}. Fix: drop --enable-unified-memory.",
        ),
        (
            "deepseek_v4.json",
            ["--enable-unified-memory"],
            "--enable-unified-memory is not supported for DeepseekV4ForCausalLM: DeepSeek-V4 keeps its own "
            f"compressed and sliding-window pools, which are never unified; {UNIFIED_SUPPORTED}. Fix: drop "
            "--enable-unified-memory.",
        ),
        (
            "gpt_oss.json",
            ["--enable-unified-memory", "--disaggregation-mode", "decode"],
            "--enable-unified-memory is not supported for GptOssForCausalLM (hybrid sliding-window) with "
            "--disaggregation-mode decode: there is no whole-envelope transfer scheme for the sliding-window "
            f"band; {UNIFIED_SUPPORTED}. Fix: drop --enable-unified-memory, or run without PD "
            "(--disaggregation-mode null).",
        ),
        (
            "bamba.json",
            ["--memory-gib", "0.1"],
            "the memory budget of 0.100 GiB (107374182 bytes) cannot hold one request of BambaForCausalLM at "
            "--context-len 4096: it needs 173436416 bytes (state slot 123104768 bytes, 12288 KV bytes per "
            "token). Fix: raise --memory-gib to at least 0.162, or lower --context-len.",
        ),
        (
            "bamba.json",
            ["--memory-gib", "0.2", "--mamba-state-ratio", "0.1"],
            "the static state/KV split of the budget cannot hold one request of BambaForCausalLM at "
            "--context-len 4096 (one request needs 173436416 bytes in all). Fix: raise --memory-gib, lower "
            "--context-len, change the split ratio, or use --enable-unified-memory for a hybrid model.",
        ),
        ("llama3.json", ["--page-size", "0"], "--page-size must be >= 1; got 0"),
        ("bamba.json", ["--mamba-state-ratio", "1.5"], "--mamba-state-ratio must be in (0, 1); got 1.5"),
        (
            "llama3.json",
            ["--kv-dtype", "int4"],
            "--kv-dtype must be one of bfloat16, float16, float32, float64, float8_e4m3fn, float8_e5m2 (or "
            "bf16, fp16, fp32, fp8_e4m3); got 'int4'",
        ),
    ],
)
def test_check_prints_sizing_refusals_with_the_flag_and_the_fix(capsys, fixture, flags, printed):
    assert main(["check", str(FIXTURES / fixture), *flags]) == 2
    assert capsys.readouterr().err == f"distpool: error: {printed}\n"


def test_a_rank_pool_refusal_names_the_role_s_tp_flag():
    needs = RequestNeeds(
        architectures="BambaForCausalLM",
        context_len=16,
        needed_bytes=4096,
        slot_bytes=2048,
        kv_bytes_per_token=8,
    )
    refusal = RankPoolRefused("prefill", 2, BudgetTooSmall(needs, 1024, "state/KV"))
    assert error_text(refusal) == (
        "--prefill-tp 2: the static state/KV split of the budget cannot hold one request of BambaForCausalLM "
        "at --context-len 16 (one request needs 4096 bytes in all). Fix: raise --memory-gib, lower "
        "--context-len, change the split ratio, or use --enable-unified-memory for a hybrid model."
    )


def test_too_few_nodes_for_a_spread_names_the_flag_and_the_fix():
    assert error_text(TooFewNodes(3, 1)) == (
        "--spread puts each of the 3 workers on its own node, but the cluster has 1 node(s). "
        "Fix: drop --spread, or add nodes"
    )
