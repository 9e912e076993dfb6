"""The PD benchmark runs end to end on a tiny case and writes the rows its JSON promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import FIXTURES

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
KEYS = {"prompt_tokens", "envelope_bytes", "transfer_ms", "transfer_gbps", "link_gbps", "link_utilization"}


def test_bench_pd_reports_one_row_per_prompt_length(tmp_path):
    out, plot = tmp_path / "pd.json", tmp_path / "pd.png"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "scripts/bench_pd.py", "--model", str(FIXTURES / "jamba.json")]
    command += ["--lengths", "64,512", "--requests", "2", "--json", str(out), "--plot", str(plot)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["prompt_tokens"] for r in rows] == [64, 512]
    for row in rows:
        assert KEYS | {"ttft_ms", "ttft_breakdown_ms", "verified_envelopes"} == set(row)
        assert row["verified_envelopes"] >= 2 and row["link_gbps"] > 0 and row["transfer_gbps"] > 0
        assert 0 < row["transfer_ms"] < row["ttft_ms"]
    assert rows[1]["envelope_bytes"] > rows[0]["envelope_bytes"]  # 448 more tokens of KV
    assert plot.stat().st_size > 0 and "utilization" in done.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--requests", "0"], "--requests must be at least 1"),
        (["--lengths", "0"], "--lengths must be 1 token or more"),
        (["--lengths", "1k"], "--lengths must be comma-separated token counts"),
        (["--memory-gib", "1000"], "--memory-gib 1000 for each of 2 workers"),
        (["--memory-gib", "nan"], "--memory-gib must be a positive number"),
    ],
)
def test_bench_pd_refuses_bad_arguments_before_ray_starts(args, expected):
    """`--requests 0` once printed an all-zero table and exited 0; `--lengths 0` and a budget beyond
    the machine started Ray and ended in a traceback."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "scripts/bench_pd.py", "--model", str(FIXTURES / "jamba.json"), *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout + done.stderr)[-2000:]
    assert expected in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "1P1D" not in done.stdout  # Ray never started


def test_bench_pd_serves_one_workload_three_ways_and_the_policy_without_its_cost_model(tmp_path):
    out = tmp_path / "policies.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "scripts/bench_pd.py", "--model", str(FIXTURES / "jamba.json")]
    command += ["--workload", "multi-turn", "--requests", "4", "--turns", "2", "--max-new-tokens", "4"]
    command += ["--context-len", "4096", "--memory-gib", "0.5", "--with-always-local", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    policies = json.loads(out.read_text())["policies"]
    assert list(policies) == ["no_cache", "cache", "conditional", "conditional_always"]
    for figures in policies.values():
        assert figures["completed"] == 4 and figures["corrupt_envelopes"] == 0
        assert figures["verified_envelopes"] == 4 and figures["leaked_slots"] == 0
        assert set(figures["ttft_ms"]) == set(figures["tpot_ms"]) == {"p50", "p99"}
        assert set(figures["ttft_ms_by_path"]) == {"remote", "local"}
    always, cache = policies["conditional_always"], policies["cache"]
    assert always["local_prefills"] == 2 and always["prefill_tokens_computed_decode"] > 0
    assert always["transfer_bytes"] < cache["transfer_bytes"] < policies["no_cache"]["transfer_bytes"]
    # Decode keeps every finished request's state only where local prefill may use it.
    assert policies["no_cache"]["decode_state_checkpoints"] == cache["decode_state_checkpoints"] == 0
    assert always["decode_state_checkpoints"] == policies["conditional"]["decode_state_checkpoints"] == 4
