"""Ctrl-C: the run writes the summary of what ended by then and exits 130, without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from distpool import cli

pytestmark = pytest.mark.ray


def test_ctrl_c_mid_run_writes_the_summary_of_what_completed_and_exits_130(tmp_path):
    """Regression: Ctrl-C gave a KeyboardInterrupt traceback and no summary."""
    out = tmp_path / "run.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "distpool", "run", "--requests", "300", "--max-new-tokens", "24"]
    # Its own session: the signal goes to the run's whole process group, as a terminal's Ctrl-C does.
    run = subprocess.Popen(
        [*command, "--json", str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # A suite started as a background job (no job control) ignores SIGINT, and a child inherits
        # that: the run would never see the Ctrl-C. A terminal's child has the default disposition.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    try:
        for line in iter(run.stdout.readline, b""):
            lines.append(line.decode())
            if "progress:" in lines[-1] and "progress: 0/" not in lines[-1]:
                os.killpg(run.pid, signal.SIGINT)
                break
        rest, _ = run.communicate(timeout=120)
    finally:
        run.kill()
    output = "".join(lines) + rest.decode()
    assert run.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert "distpool PD run summary" in output and "interrupted: not finished" in output
    report = json.loads(out.read_text())
    assert report["interrupted"] and report["requests"] == 300
    assert report["completed"] > 0 and report["unfinished"] > 0
    assert report["completed"] + report["failed"] + report["unfinished"] == 300
    # Requests in flight still held memory: the leaks were not read, and say so.
    assert report["leaked_pages"] is None and set(report["leaks_unchecked"].values()) == {"interrupted"}


def test_ctrl_c_before_a_run_starts_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(ns):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_presets", interrupted)
    assert cli.main(["presets"]) == 130
    err = capsys.readouterr().err
    assert err == "distpool: interrupted\n"
