"""`--model-impl`, `--load-format`, `--dtype` and `--outputs` on the command line: what `check`
reports, what `run` refuses before Ray starts (one line, exit 2), and that `check`, `presets` and
the reference model never import transformers."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from distpool.cli import main
from distpool.cli.errors import error_text
from distpool.memory.sizing import GIB
from distpool.model_impl.errors import (
    NOT_MAMBA2_HYBRID,
    TOO_LARGE,
    CheckpointDtypeUnsupported,
    ImplCannotRun,
    NoWeights,
    WeightOptionsUnused,
)
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.serving.job.preflight import check_fits_this_machine
from distpool.serving.job.run_memory import RunMemory
from distpool.worker.config import WorkerConfig
from tests.factories import FIXTURES


def check_json(capsys, *args: str) -> dict:
    assert main(["check", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_check_keeps_the_engine_sizes_unless_asked_for_the_transformers_runners(capsys, hf_checkpoints):
    folder = str(hf_checkpoints["bamba"])
    engine = check_json(capsys, folder, "--page-size", "4")
    runner = check_json(
        capsys, folder, "--page-size", "4", "--model-impl", "transformers", "--dtype", "float64"
    )
    assert (engine["model_impl"], engine["dtype"]) == ("reference", "float64")
    assert (runner["model_impl"], runner["dtype"]) == ("transformers", "float64")
    # 2 Mamba layers: conv 80 x 3 and state 4 x 16 x 8, float32 (the engine convention), against
    # conv 80 x 4 in float64 and the same state in float32 (what transformers keeps).
    assert engine["slot_bytes"] == 2 * (80 * 3 * 4 + 4 * 16 * 8 * 4)
    assert runner["slot_bytes"] == 2 * (80 * 4 * 8 + 4 * 16 * 8 * 4)
    # one attention layer, 4 tokens of 2 KV heads x 8 dims, K and V
    assert (engine["page_bytes"], runner["page_bytes"]) == (4 * 2 * 8 * 2 * 4, 4 * 2 * 8 * 2 * 8)
    synthetic = check_json(capsys, str(FIXTURES / "qwen3_next.json"), "--kv-dtype", "fp8_e4m3")
    assert (synthetic["model_impl"], synthetic["dtype"]) == ("synthetic", "float8_e4m3fn")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model", str(FIXTURES / "llama3.json"), "--model-impl", "transformers"],
            "--model-impl synthetic",
        ),
        (["--model", "nemotron-h-8b", "--model-impl", "transformers"], "--load-format dummy"),
        (["--model-impl", "reference", "--dtype", "float32"], "add --model-impl transformers"),
        (["--model-impl", "synthetic", "--load-format", "dummy"], "add --model-impl transformers"),
    ],
)
def test_run_refuses_what_the_implementation_cannot_do_before_ray_starts(capsys, args, message):
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_transformers_runner_refuses_kv_and_ssm_dtype_overrides(capsys, hf_checkpoints):
    assert main(["run", "--model", str(hf_checkpoints["jamba"]), "--kv-dtype", "bf16"]) == 2
    assert "--kv-dtype and --ssm-dtype apply to the reference model" in capsys.readouterr().err


def test_the_memory_check_counts_the_weights_in_every_worker_and_the_parity_oracle(hf_checkpoints):
    from distpool.model_impl.select import resolve_implementation

    impl = resolve_implementation(hf_checkpoints["bamba"] / "config.json", "transformers")
    worker = WorkerConfig(spec=impl.spec, budget_bytes=1 << 20, model_impl="transformers", hf=impl.hf)
    heavier = dataclasses.replace(impl.hf, weight_bytes=impl.hf.weight_bytes + GIB)
    grown = RunMemory.of(dataclasses.replace(worker, hf=heavier), 1, 2).total_bytes
    assert grown - RunMemory.of(worker, 1, 2).total_bytes == 4 * GIB  # three workers and the driver
    check_fits_this_machine(worker, 1, 1)  # tiny: fits
    huge = dataclasses.replace(worker, hf=dataclasses.replace(impl.hf, weight_bytes=4096 * GIB))
    with pytest.raises(ValueError, match="this machine has"):
        check_fits_this_machine(huge, 1, 1)


def test_check_presets_and_the_reference_model_never_import_transformers():
    script = """
import sys
from distpool.cli import main
from distpool.model.hf_config import spec_from_hf
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.model_impl.select import build_model_impl
assert main(["check", "nemotron-h-8b", "--json"]) == 0
assert main(["presets"]) == 0
spec = spec_from_hf(REFERENCE_HYBRID_CONFIG)
model = build_model_impl(spec, model_impl="reference", seed=0, device="cpu")
assert model.next_token_logits([1, 2, 3]).shape == (spec.vocab_size,)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "safetensors"))
print("LOADED", loaded)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED []" in proc.stdout


def test_outputs_is_checked_before_the_run_and_never_replaces_an_input(capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    assert main(["run", "--prompts", str(prompts), "--outputs", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "--outputs" in err and "would destroy the input" in err
    assert prompts.read_text() == '{"prompt_ids": [1, 2, 3]}\n'
    assert main(["run", "--prompts", str(prompts), "--outputs", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("refusal", "printed"),
    [
        (
            ImplCannotRun("reference", "m.json", "m.json is dense"),
            "m.json is dense; or run it with the synthetic cache (--model-impl synthetic)",
        ),
        (
            ImplCannotRun("reference", "m.json", "m.json is dense", NOT_MAMBA2_HYBRID),
            f"m.json is dense. Fix: use {REFERENCE_HYBRID_CONFIG} or another Mamba2 hybrid config; or run it "
            "with the synthetic cache (--model-impl synthetic)",
        ),
        (
            ImplCannotRun("reference", "m.json", "m.json is big", TOO_LARGE),
            f"m.json is big. Fix: use {REFERENCE_HYBRID_CONFIG} or shrink hidden_size / vocab_size / "
            "layers; or run it with the synthetic cache (--model-impl synthetic)",
        ),
        (
            ImplCannotRun("transformers", "m.json", "m.json: LlamaForCausalLM is not one of them"),
            "m.json: LlamaForCausalLM is not one of them. Fix: run it at its true sizes without weights "
            "(--model-impl synthetic)",
        ),
        (
            WeightOptionsUnused("synthetic", "float32", "auto"),
            "--dtype and --load-format set the transformers runner's weights; the synthetic cache keeps "
            "--kv-dtype / --ssm-dtype. Fix: drop them, or add --model-impl transformers",
        ),
        (
            NoWeights("/models/bamba", "safetensors"),
            "/models/bamba holds no *.safetensors weights beside a config.json, so --load-format "
            "safetensors has nothing to load. Fix: pass the checkpoint's folder, or --load-format dummy for "
            "seeded random weights from the config alone",
        ),
        (
            CheckpointDtypeUnsupported("float8_e4m3fn", ("float64", "float32")),
            "the checkpoint is stored in float8_e4m3fn, which the runner does not compute in. "
            "Fix: --dtype float32",
        ),
    ],
)
def test_implementation_refusals_are_worded_with_the_flag_and_the_fix(refusal, printed):
    assert error_text(refusal) == printed
