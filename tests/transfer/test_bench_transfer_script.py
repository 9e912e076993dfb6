"""The transfer benchmark runs end to end on a tiny case and writes the rows its JSON promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_transfer_writes_one_row_per_method_and_case(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "scripts/bench_transfer.py", "--sizes-mib", "1", "--repeats", "1"]
        + ["--json", str(out), "--plot", str(tmp_path / "plot.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    cases = {(r["method"], r["fragmentation"]) for r in rows}
    assert cases == {(m, f) for m in ("envelope", "raw", "naive") for f in (0.0, 0.5, 1.0)}
    for row in rows:
        assert set(row) == {"method", "bytes", "pages", "fragmentation", "gbps"}
        assert row["bytes"] == row["pages"] * 384 * 1024 and row["gbps"] > 0
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert "env/raw" in done.stdout and "[9/9]" not in done.stdout  # progress goes to stderr
    assert "[3/3]" in done.stderr
