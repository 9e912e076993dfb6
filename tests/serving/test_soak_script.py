"""scripts/soak.py runs end to end on a small case and writes the promised JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def test_the_soak_injects_every_kind_and_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(SCRIPT), "--requests", "80", "--kills", "1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    keys = {"requests", "completed", "failed", "faults_injected", "kinds", "leaked_pages", "leaked_slots"}
    assert keys | {"corrupt_accepted"} <= set(result)
    assert result["requests"] == result["completed"] + result["failed"] == 80
    assert (result["leaked_pages"], result["leaked_slots"], result["corrupt_accepted"]) == (0, 0, 0)
    assert result["kinds"]["worker_kill"] == 1 and len(result["kinds"]) == 6
    assert result["faults_injected"] == sum(result["kinds"].values()) >= 40
    # Struck: planned on a worker and taken by its transfer, never more than were drawn.
    assert 0 < sum(result["struck"].values())
    assert all(0 <= n <= result["kinds"][kind] for kind, n in result["struck"].items())
