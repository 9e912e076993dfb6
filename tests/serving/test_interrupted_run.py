"""Ctrl-C and SIGTERM: the run writes the summary, --json and --outputs of what ended by then and
exits 130 (143 after SIGTERM), without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from distpool import cli

pytestmark = pytest.mark.ray


@pytest.mark.parametrize(
    "signum, status, to_group",
    [
        # Ctrl-C: a terminal sends it to the run's whole process group.
        (signal.SIGINT, 130, True),
        # SIGTERM, as `timeout`, Kubernetes and `ray job stop` send it: to the run's process.
        (signal.SIGTERM, 143, False),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_an_interrupted_run_writes_the_summary_json_and_outputs_of_what_completed(
    tmp_path, signum, status, to_group
):
    """Regression: Ctrl-C gave a KeyboardInterrupt traceback and no summary; SIGTERM (issue 34)
    exited 15 within seconds with no summary, no --json and no --outputs."""
    out, outputs = tmp_path / "run.json", tmp_path / "outputs.jsonl"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "distpool", "run", "--requests", "300", "--max-new-tokens", "24"]
    # Its own session: a signal to the group reaches the run's whole process group, as a terminal's does.
    run = subprocess.Popen(
        [*command, "--json", str(out), "--outputs", str(outputs)],
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
                if to_group:
                    os.killpg(run.pid, signum)
                else:
                    os.kill(run.pid, signum)
                break
        rest, _ = run.communicate(timeout=120)
    finally:
        run.kill()
    output = "".join(lines) + rest.decode()
    assert run.returncode == status, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert "distpool PD run summary" in output and "interrupted: not finished" in output
    report = json.loads(out.read_text())
    assert report["interrupted"] and report["requests"] == 300
    assert report["completed"] > 0 and report["unfinished"] > 0
    assert report["completed"] + report["failed"] + report["unfinished"] == 300
    # Requests in flight still held memory: the leaks were not read, and say so.
    assert report["leaked_pages"] is None and set(report["leaks_unchecked"].values()) == {"interrupted"}
    served = [json.loads(line) for line in outputs.read_text().splitlines()]
    assert len(served) == report["completed"] and all(len(s["output_ids"]) == 24 for s in served)


def test_ctrl_c_before_a_run_starts_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(ns):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_presets", interrupted)
    assert cli.main(["presets"]) == 130
    err = capsys.readouterr().err
    assert err == "distpool: interrupted\n"


def test_sigterm_before_a_run_starts_is_one_line_and_143(monkeypatch, capsys):
    from distpool.serving.interrupt import Terminated

    def terminated(ns):
        raise Terminated

    monkeypatch.setattr(cli, "cmd_presets", terminated)
    assert cli.main(["presets"]) == 143
    assert capsys.readouterr().err == "distpool: terminated\n"
