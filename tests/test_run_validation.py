"""`distpool run` and `check` refuse bad input before Ray starts: exit 2, one line, the flag named."""

from __future__ import annotations

import json
import time

import pytest
import torch

from distpool.cli import main
from distpool.serving import preflight
from tests.factories import FIXTURES


def run_refused(capsys, *args: str) -> str:
    """Run `distpool run ARGS`, which must be refused; returns stderr."""
    started = time.monotonic()
    assert main(["run", *args]) == 2
    assert time.monotonic() - started < 10  # refused at once: no Ray, no actor, no hang
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


def test_an_unknown_device_is_refused(capsys):
    assert "--device must be one of auto, cpu, cuda" in run_refused(capsys, "--device", "bogus")


def test_cuda_without_a_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device is visible" in run_refused(capsys, "--device", "cuda")


def test_a_budget_beyond_this_machine_is_refused_by_run_but_planned_by_check(capsys, monkeypatch):
    monkeypatch.setattr(preflight, "_available_host_bytes", lambda: 24 << 30)
    assert "this machine has 24.0 GiB available" in run_refused(capsys, "--memory-gib", "100")
    assert main(["check", str(FIXTURES / "llama3.json"), "--memory-gib", "80"]) == 0


def test_an_address_where_nothing_listens_is_refused_at_once(capsys):
    assert "no Ray cluster answers there" in run_refused(capsys, "--address", "127.0.0.1:1")


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        ("DISTPOOL_CHUNK_MIB", "0", "DISTPOOL_CHUNK_MIB must be 1 to 1024"),
        ("DISTPOOL_CHUNK_MIB", "4096", "DISTPOOL_CHUNK_MIB must be 1 to 1024"),
        ("DISTPOOL_CHUNK_MIB", "lots", "DISTPOOL_CHUNK_MIB='lots' is not an integer"),
        ("DISTPOOL_TRANSFER_TIMEOUT_S", "-1", "DISTPOOL_TRANSFER_TIMEOUT_S: the transfer timeout"),
        ("DISTPOOL_TRANSFER_TIMEOUT_S", "nan", "DISTPOOL_TRANSFER_TIMEOUT_S: the transfer timeout"),
    ],
)
def test_bad_environment_values_are_refused_naming_the_variable(
    capsys, monkeypatch, variable, value, expected
):
    monkeypatch.setenv(variable, value)
    assert expected in run_refused(capsys)


@pytest.mark.parametrize("value", ["0", "0.0001", "-3", "nan", "4000"])
def test_transfer_timeouts_outside_a_tenth_of_a_second_to_an_hour_are_refused(capsys, value):
    assert "--transfer-timeout: the transfer timeout must be 0.1 to 3600" in run_refused(
        capsys, "--transfer-timeout", value
    )


def test_a_deeply_nested_config_or_prompts_file_is_refused(capsys, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    config = tmp_path / "config.json"
    config.write_text(deep)
    assert "nests too deeply" in run_refused(capsys, "--model", str(config))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(deep + "\n")
    assert "nests too deeply" in run_refused(capsys, "--prompts", str(prompts))


def test_a_prompts_file_that_is_not_utf8_is_named(capsys, tmp_path):
    prompts = tmp_path / "latin1.jsonl"
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert f"prompts file {prompts} is not UTF-8" in run_refused(capsys, "--prompts", str(prompts))


@pytest.mark.parametrize("rid", ["", "x" * 300, True, None])
def test_a_prompt_id_no_envelope_can_carry_is_refused(capsys, tmp_path, rid):
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text(json.dumps({"id": rid, "prompt_ids": [1, 2, 3]}) + "\n")
    assert "id must be a string" in run_refused(capsys, "--prompts", str(prompts))


def test_attention_heads_must_group_over_kv_heads(capsys, tmp_path):
    config = json.loads((FIXTURES / "llama3.json").read_text())
    config["num_key_value_heads"] = 5  # 32 heads do not split into 5 groups
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["check", str(path)]) == 2
    assert "must be a multiple of the KV heads (5)" in capsys.readouterr().err


def test_an_attention_free_model_reports_capacity_without_a_context_limit(capsys):
    assert main(["check", str(FIXTURES / "mamba2.json"), "--memory-gib", "4"]) == 0
    out = capsys.readouterr().out
    assert "requests of any length (state only, no KV)" in out and "at full context" not in out


def test_the_default_budget_fits_the_model_and_this_machine(monkeypatch):
    from distpool.memory.sizing import GIB, PoolArgs, size_pools
    from distpool.model.hf_config import spec_from_hf
    from distpool.model.presets import resolve_model

    monkeypatch.setattr(preflight, "_available_host_bytes", lambda: 24 << 30)
    spec = spec_from_hf(resolve_model("nemotron-h-8b"))
    args = PoolArgs(enable_unified_memory=True, context_len=4096)  # what run resolves for hybrid Mamba
    assert preflight.default_budget_bytes(spec, args, "reference", 2) == 256 << 20
    budget = preflight.default_budget_bytes(spec, args, "synthetic", 2)
    assert budget % (256 << 20) == 0 and budget <= 0.4 * 24 * GIB / 2
    assert size_pools(spec, args, budget).requests_at_full_context >= 4  # room for a small batch
    monkeypatch.setattr(preflight, "_available_host_bytes", lambda: 2 << 30)  # a small machine: capped
    assert preflight.default_budget_bytes(spec, args, "synthetic", 2) == 256 << 20
