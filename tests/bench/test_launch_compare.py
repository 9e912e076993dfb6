"""--launch and --compare with a stand-in for `distpool serve` (tests/bench/standin_server.py):
each deployment started on a free port, waited for, measured on the same workload, stopped with
SIGTERM and its exit checked; the side-by-side table, JSON and PNG."""

from __future__ import annotations

import json
import sys

import pytest

from distpool.bench import launch
from distpool.bench.launch import LaunchError, launched_server
from distpool.cli import main

STAND_IN = (sys.executable, "-m", "tests.bench.standin_server")


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(launch, "DISTPOOL_SERVE", STAND_IN)


def test_compare_serves_one_workload_to_each_deployment(stand_in, tmp_path, capsys):
    doc_path, png = tmp_path / "compare.json", tmp_path / "compare.png"
    status = main([
        "bench", "serve", "--compare", "fast:", "slow:--step-delay 0.06",
        "--launch-args", "--step-delay 0.001", "--request-rate", "20,50", "--num-prompts", "6",
        "--dataset", "random", "--input-len", "8", "--output-len", "5",
        "--goodput", "tpot:30", "--json", str(doc_path), "--plot", str(png),
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert status == 0, captured.err
    doc = json.loads(doc_path.read_text())
    assert doc["config"]["deployments"] == {
        "fast": ["--step-delay", "0.001"],
        "slow": ["--step-delay", "0.001", "--step-delay", "0.06"],  # the last one given counts
    }
    runs = {(r["deployment"], r["request_rate"]): r for r in doc["runs"]}
    assert set(runs) == {("fast", 20.0), ("fast", 50.0), ("slow", 20.0), ("slow", 50.0)}
    assert all(r["completed"] == 6 and r["total_output_tokens"] == 30 for r in runs.values())
    # the same seeded workload for both: the same prompts, so the same input tokens
    assert {r["total_input_tokens"] for r in runs.values()} == {48}
    # TPOT: about 1 ms a token against 60 (a sleep is never shorter): 30 ms tells them apart
    assert runs["fast", 50.0]["slo_attainment"] == 1.0 and runs["slow", 20.0]["slo_attainment"] == 0.0
    found = doc["rate_at_attainment"]
    assert found["fast"]["kind"] == "measured" and found["fast"]["rate"] == 50.0
    assert found["slow"] == {
        "target": 0.9,
        "rate": None,
        "kind": "none",
        "measured": [[20.0, 0.0], [50.0, 0.0]],
    }
    table = captured.out[captured.out.index("rate |") :]
    assert "fast" in table and "slow" in table and "tpot p99" in table
    assert "fast: highest rate at 90% SLO attainment: at least 50 req/s" in captured.out
    assert captured.err.count("launching:") == 2 and captured.err.count("server ready at") == 2
    assert captured.err.count("server stopped, exit status 0: stopped after serving") == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_server_failing_its_drain_fails_the_bench(stand_in, capsys):
    status = main(
        ["bench", "serve", "--launch", "--exit-status 5", "--num-prompts", "2", "--output-len", "3"]
    )
    assert status == 1
    assert "exited with status 5 after SIGTERM" in capsys.readouterr().err


def test_a_server_that_exits_before_answering_shows_its_log():
    command = (sys.executable, "-c", "print('no such model: nope'); raise SystemExit(3)")
    with pytest.raises(LaunchError, match="(?s)exited with status 3 before answering.*no such model: nope"):
        with launched_server([], command=command, progress=lambda line: None):
            pytest.fail("never reached")


def test_a_server_that_never_answers_is_killed_at_the_deadline():
    command = (sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(120)")
    notes: list[str] = []
    with pytest.raises(LaunchError, match="(?s)within 1 s.*--launch-timeout.*loading"):
        with launched_server([], command=command, start_timeout_s=1.0, progress=notes.append):
            pytest.fail("never reached")
    assert notes[0].startswith("launching: ")
