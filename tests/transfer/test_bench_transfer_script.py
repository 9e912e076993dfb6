"""The transfer benchmark runs end to end on a tiny case and writes the rows its JSON promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE_BYTES = 384 * 1024


def run_bench(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "scripts/bench_transfer.py", "--sizes-mib", "1", "--repeats", "1", *extra]
        + ["--json", str(out), "--plot", str(tmp_path / "plot.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done, json.loads(out.read_text())


def check_churn_row(row: dict) -> None:
    """A churn envelope: its state slot (~49 MiB) and at least one page, as the traces placed them."""
    messages = {"messages"} if row["method"] == "raw_msgs" else set()
    assert set(row) == {"method", "bytes", "pages", "fragmentation", "gbps", "runs", *messages}
    assert row["pages"] >= 1 and row["bytes"] > row["pages"] * PAGE_BYTES and row["gbps"] > 0
    assert len(row["runs"]) == 2 and all(2 <= runs <= row["pages"] + 1 for runs in row["runs"])


def test_bench_transfer_writes_one_row_per_method_and_case(tmp_path):
    done, rows = run_bench(tmp_path)
    *rows, overhead = rows
    # What a transfer costs beyond its bytes: a one-page envelope against the page as one message.
    assert set(overhead) == {"method", "bytes", "envelope_us", "raw_us", "overhead_us"}
    assert (overhead["method"], overhead["bytes"]) == ("overhead", PAGE_BYTES)
    assert overhead["envelope_us"] > 0 and overhead["raw_us"] > 0
    assert overhead["overhead_us"] == overhead["envelope_us"] - overhead["raw_us"]
    assert "per-transfer overhead:" in done.stdout
    cases = {(r["method"], r["fragmentation"]) for r in rows}
    methods = ("envelope", "raw", "raw_msgs", "naive")
    assert cases == {(m, f) for m in methods for f in (0.0, 0.5, 1.0, "churn")}
    for row in rows:
        if row["fragmentation"] == "churn":
            check_churn_row(row)
            continue
        messages = {"messages"} if row["method"] == "raw_msgs" else set()
        assert set(row) == {"method", "bytes", "pages", "fragmentation", "gbps", *messages}
        assert row["bytes"] == row["pages"] * PAGE_BYTES and row["gbps"] > 0
    # The raw msgs rows send what the engine's plan does: three pages back to back on both sides go
    # as one message, three pages scattered on both sides as three (384 KiB: each zero-copy).
    sent = {r["fragmentation"]: r["messages"] for r in rows if r["method"] == "raw_msgs"}
    assert (sent[0.0], sent[1.0]) == (1, 3)
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert "env/raw" in done.stdout and "env/msgs" in done.stdout
    assert "[4/4]" not in done.stdout  # progress goes to stderr
    assert "[4/4]" in done.stderr
    assert " churn " in done.stdout  # the table shows the churn case


def test_bench_transfer_fragmented_churn_runs_only_churn_cases(tmp_path):
    done, rows = run_bench(tmp_path, "--fragmented", "churn")
    rows = [r for r in rows if r["method"] != "overhead"]
    assert {(r["method"], r["fragmentation"]) for r in rows} == {
        (m, "churn") for m in ("envelope", "raw", "raw_msgs", "naive")
    }
    for row in rows:
        check_churn_row(row)
    assert "[1/1]" in done.stderr and "fragmented: churn" in done.stdout


def test_bench_transfer_tp_rows_put_heterogeneous_beside_equal_tp_at_the_same_bytes(tmp_path):
    done, rows = run_bench(tmp_path, "--tp-only", "--tp", "2:1", "--tp-requests", "1", "--tp-tokens", "16")
    assert len(rows) == 1
    row = rows[0]
    assert set(row) == {
        "method", "tp", "equal_tp", "requests", "tokens", "bytes", "channels",
        "equal_channels", "gbps", "equal_gbps", "ratio", "cpu_ms", "equal_cpu_ms",
    }  # fmt: skip
    assert (row["method"], row["tp"], row["equal_tp"]) == ("tp_envelope", "2:1", "1:1")
    assert (row["channels"], row["equal_channels"], row["requests"], row["tokens"]) == (2, 1, 1, 16)
    # one whole Bamba envelope lands on the one decode rank: its state slot and one page, no padding
    assert 117 << 20 < row["bytes"] < 118 << 20
    assert row["gbps"] > 0 and row["equal_gbps"] > 0
    assert row["ratio"] == pytest.approx(row["gbps"] / row["equal_gbps"], rel=1e-2)
    # CPU time per run of each case's two group processes (prefill, decode): both did work
    assert all(len(row[key]) == 2 and min(row[key]) > 0 for key in ("cpu_ms", "equal_cpu_ms"))
    assert "het/equal" in done.stdout and "[tp 1/1]" in done.stderr
    assert not (tmp_path / "plot.png").exists()  # --tp-only: no envelope cases to plot


@pytest.mark.parametrize("value", ["2-1", "2:1,0:1", "2:x"])
def test_bench_transfer_refuses_a_malformed_tp_pair_in_one_line(value):
    done = subprocess.run(
        [sys.executable, "scripts/bench_transfer.py", "--tp-only", "--tp", value],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--tp" in done.stderr and "Traceback" not in done.stderr


def test_transfer_timeline_times_each_step_of_small_transfers_on_both_ends():
    done = subprocess.run(
        [sys.executable, "scripts/transfer_timeline.py", "--transfers", "12"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "one-page transfers: 2 (2 with the receiver's offer at hand)," in done.stdout, done.stdout
    steps = [line.split() for line in done.stdout.splitlines()[2:]]
    names = [step[1] for step in steps]
    # both processes' steps, the control messages by name, the caller's wait last on each side
    for name in ("ctl.send:offer>", "ctl.send:bell>", "ctl.got:status<", "waited"):
        assert name in names, done.stdout
    assert {step[0] for step in steps} == {"S", "R"}, done.stdout
    times = [float(step[2]) for step in steps]
    assert times == sorted(times) and times[-1] > 0, done.stdout
