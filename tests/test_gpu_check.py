"""scripts/gpu_check: its no-GPU path end to end, and its device checks run on CPU (cpu vs cpu).

The pool, gather/scatter and token checks take a device argument, so the code a GPU machine runs is
the code exercised here, on small arenas.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from distpool.memory.arena import Arena
from distpool.model.presets import resolve_model
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG

ROOT = Path(__file__).resolve().parents[1]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_gpu_check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script would run every check")
def test_without_a_gpu_the_script_says_so_writes_the_reason_and_exits_0(tmp_path):
    out = tmp_path / "g.json"
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no GPU" in done.stdout
    result = json.loads(out.read_text())
    assert set(result) == {"gpus", "skipped"}
    assert result["gpus"] == 0 and isinstance(result["skipped"], str) and result["skipped"]


def test_pool_check_keeps_patterns_across_both_compactions_on_cpu():
    cases = {
        "reference-hybrid": (REFERENCE_HYBRID_CONFIG, 8 << 20, 1024),
        # ~97 MiB state slots: compaction moves whole slots
        "nemotron-h-8b": (resolve_model("nemotron-h-8b"), 768 << 20, 1024),
    }
    outcome = gpu_check.run_check(lambda: gpu_check.check_pool("cpu", cases))
    assert outcome["ok"], outcome
    for name in cases:
        figures = outcome[name]
        assert figures["requests_moved"] >= 1
        assert figures["reserve_compaction"]["bytes"] > 0
        assert figures["compact"]["bytes"] > 0
        assert figures["big_request_tokens"] > 1024  # bigger than any request of the batches


def test_reference_tokens_check_compares_cpu_with_cpu():
    outcome = gpu_check.run_check(lambda: gpu_check.check_reference_tokens("cpu", reference_device="cpu"))
    assert outcome["ok"], outcome
    assert outcome["mismatched_prompts"] == 0
    assert outcome["prompt_lens"] == list(gpu_check.TOKEN_PROMPT_LENS)


def test_staged_gather_scatter_check_on_a_small_cpu_arena():
    outcome = gpu_check.run_check(
        lambda: gpu_check.check_staged_gather_scatter("cpu", arena_bytes=8 << 20, num_pieces=32)
    )
    assert outcome["ok"], outcome
    assert outcome["bytes"] == 32 * (64 << 10)
    assert outcome["gather_gbps"] > 0 and outcome["contiguous_copy_gbps"] > 0
    assert outcome["gather_vs_copy"] == pytest.approx(
        outcome["gather_gbps"] / outcome["contiguous_copy_gbps"], 0.01
    )


def test_gather_scatter_refuses_more_pieces_than_the_arena_has_twice():
    outcome = gpu_check.run_check(
        lambda: gpu_check.check_staged_gather_scatter("cpu", arena_bytes=1 << 20, num_pieces=16)
    )
    assert outcome["ok"] is False and "ValueError" in outcome["error"]


def test_two_gpu_checks_are_skipped_with_one_gpu_and_carry_no_ok():
    for check in (gpu_check.check_pd_run, gpu_check.check_gpu2_tests):
        outcome = gpu_check.run_check(lambda check=check: check(1))
        assert "ok" not in outcome and "two GPUs" in outcome["skipped"]
    outcome = gpu_check.run_check(lambda: gpu_check.check_tp_runs(2))
    assert "ok" not in outcome and "three GPUs" in outcome["skipped"]


def test_a_failing_check_records_its_error_and_figures():
    def fails():
        raise gpu_check.CheckFailed("2 prompts differ", {"mismatched_prompts": 2})

    def crashes():
        raise RuntimeError("CUDA error: out of memory")

    failed = gpu_check.run_check(fails)
    assert (
        failed["ok"] is False and failed["error"] == "2 prompts differ" and failed["mismatched_prompts"] == 2
    )
    crashed = gpu_check.run_check(crashes)
    assert crashed["ok"] is False and crashed["error"] == "RuntimeError: CUDA error: out of memory"
    assert "wall_s" in failed and "wall_s" in crashed


@pytest.mark.parametrize("broken", ["gather", "scatter"])
def test_gather_scatter_check_catches_a_copy_that_moves_nothing(monkeypatch, broken):
    monkeypatch.setattr(gpu_check, broken, lambda *args: None)
    outcome = gpu_check.run_check(
        lambda: gpu_check.check_staged_gather_scatter("cpu", arena_bytes=8 << 20, num_pieces=32)
    )
    assert outcome["ok"] is False and outcome["error"].startswith(f"{broken}:")


def test_pool_check_catches_a_compaction_that_forgets_to_copy_bytes(monkeypatch):
    monkeypatch.setattr(Arena, "copy_runs", lambda self, runs_bytes: None)
    cases = {"reference-hybrid": (REFERENCE_HYBRID_CONFIG, 8 << 20, 1024)}
    outcome = gpu_check.run_check(lambda: gpu_check.check_pool("cpu", cases))
    assert outcome["ok"] is False
    assert "bytes changed across reserve(compact=True)" in outcome["error"]
