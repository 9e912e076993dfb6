"""`DISTPOOL_CHUNK_MIB` end to end: every value the command line accepts serves requests."""

import json

import pytest

from distpool.cli import main

pytestmark = pytest.mark.ray


def test_a_chunk_above_256_mib_serves_every_request(ray_session, tmp_path, monkeypatch):
    """Regression: DISTPOOL_CHUNK_MIB=512 passed validation, then every transfer was refused (the
    decode end kept a 256 MiB limit of its own): 0 of 4 completed after 12 retries."""
    monkeypatch.setenv("DISTPOOL_CHUNK_MIB", "512")
    path = tmp_path / "run.json"
    status = main(
        ["run", "--requests", "4", "--max-new-tokens", "4", "--parity-sample", "1", "--json", str(path)]
    )
    report = json.loads(path.read_text())
    assert status == 0, report["errors"]
    assert (report["completed"], report["retried"]) == (4, 0)
