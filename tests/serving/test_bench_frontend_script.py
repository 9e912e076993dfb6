"""The front-end benchmark refuses bad arguments before Ray starts. (Its measured run takes about a
minute, a cluster of its own: too much for the suite's budget; `scripts/bench_frontend.py --quick`.)"""

from __future__ import annotations

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


def test_bench_frontend_refuses_bad_arguments_before_ray_starts():
    for args, expected in [
        (["--clients", "1,x"], "--clients must be comma-separated counts"),
        (["--prompt-len", "4000", "--context-len", "1024"], "exceed the context (1024)"),
    ]:
        done = run_script(*args, timeout=120)
        assert done.returncode == 2, (done.stdout + done.stderr)[-2000:]
        assert expected in done.stderr and "Traceback" not in done.stderr
        assert "Started a local Ray instance" not in done.stderr
