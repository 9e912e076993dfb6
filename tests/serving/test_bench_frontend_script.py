"""The front-end benchmark serves its workload in-process and over HTTP and writes the rows its JSON
promises; bad arguments are refused before Ray starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
FIGURES = {"ttft_ms", "per_token_ms", "e2e_ms", "tokens_per_s"}
COMPARE = {
    "ttft_p50_diff_ms",
    "ttft_p90_diff_ms",
    "per_token_p50_diff_ms",
    "overhead_ms_per_request",
    "e2e_mean_diff_ms",
}


def run_script(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "scripts/bench_frontend.py", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_bench_frontend_measures_both_ways_at_each_concurrency(tmp_path):
    out = tmp_path / "frontend.json"
    done = run_script(
        "--quick", "--clients", "1,2", "--requests", "2", "--max-tokens", "4", "--prompt-len", "4",
        "--json", str(out), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert [row["clients"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert set(row["direct"]) == FIGURES and set(row["http"]) == FIGURES | {"first_byte_ms"}
        assert set(row["compare"]) == COMPARE
        for way in ("direct", "http"):
            assert 0 < row[way]["ttft_ms"]["p50"] <= row[way]["ttft_ms"]["p90"] < row[way]["e2e_ms"]["p90"]
            assert row[way]["per_token_ms"]["p50"] > 0
        # The first body byte comes with, or before, the first token.
        assert 0 < row["http"]["first_byte_ms"]["p50"] <= row["http"]["ttft_ms"]["p50"]
    for summary in report["summaries"].values():  # a warm-up request and 2 per row, all served
        assert summary["served"] == 5 and summary["failed"] == summary["cancelled"] == 0
        assert summary["leaked_pages"] == summary["leaked_slots"] == 0
    assert "overhead/req" in done.stdout and "| 2 |" in done.stdout


def test_bench_frontend_refuses_bad_arguments_before_ray_starts():
    for args, expected in [
        (["--clients", "1,x"], "--clients must be comma-separated counts"),
        (["--prompt-len", "4000", "--context-len", "1024"], "exceed the context (1024)"),
    ]:
        done = run_script(*args, timeout=120)
        assert done.returncode == 2, (done.stdout + done.stderr)[-2000:]
        assert expected in done.stderr and "Traceback" not in done.stderr
        assert "Started a local Ray instance" not in done.stderr
