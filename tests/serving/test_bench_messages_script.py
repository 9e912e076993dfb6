"""scripts/bench_messages.py measures every message each way and writes the figures it promises."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_messages.py"


def test_every_message_is_timed_each_way_and_comes_back_equal(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_messages", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_messages", bench)  # pickle finds its Structs there
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "ROUNDS", 1)  # the figures do not matter here, only that each is made
    monkeypatch.setattr(bench, "CALLS_PER_ROUND", 3)
    out = tmp_path / "messages.json"
    assert bench.main(["--json", str(out)]) == 0  # each round trip is checked equal to its message
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 5
    for row in rows:
        methods = row["methods"]
        assert methods["dataclass pickle"]["vs_dataclass_pickle"] == 1.0
        assert all(m["us"] > 0 and m["bytes"] > 0 for m in methods.values())
