"""`distpool check --tp N`: one rank's bytes, what is replicated, refusals in one line, TP 1 as it
was, and the README's table of every preset at TP 1, 2, 4 and 8 as `check` computes it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from distpool.cli import main
from distpool.model.presets import preset_names

README = Path(__file__).resolve().parent.parent / "README.md"
TABLE_HEADER = "| preset | TP 1 | TP 2 | TP 4 | TP 8 | replicated |"


def check(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_rank_holds_its_heads_and_whole_copies_of_one_group(capsys):
    """Granite-4.0-H-small at TP 4: 36 Mamba layers of conv (8192 / 4 + 2 x 128, 3) bf16 and SSM
    (128 / 4, 64, 128) fp32; 4 attention layers of 8 / 4 KV heads x 128, K and V, bf16."""
    code, out, _ = check(capsys, "granite-4.0-h-small", "--tp", "4", "--json")
    figures = json.loads(out)
    assert code == 0 and figures["tp"] == 4
    assert figures["rank_slot_bytes"] == 36 * ((2048 + 256) * 3 * 2 + 32 * 64 * 128 * 4)
    assert figures["rank_page_bytes"] == 16 * 4 * 2 * 2 * 128 * 2
    assert figures["slot_bytes"] == 36 * ((8192 + 256) * 3 * 2 + 128 * 64 * 128 * 4)  # the model's
    assert figures["replicated"] == ["conv.B", "conv.C"]
    code, text, _ = check(capsys, "granite-4.0-h-small", "--tp", "4")
    assert "replicated   conv.B, conv.C (whole on every rank)" in text
    assert f"rank slot    {figures['rank_slot_bytes']} bytes" in text
    assert "budget 8.00 GiB per rank" in text


def test_tp_one_prints_what_check_always_printed(capsys):
    _, plain, _ = check(capsys, "qwen3-next-80b-a3b")
    _, with_flag, _ = check(capsys, "qwen3-next-80b-a3b", "--tp", "1")
    assert with_flag == plain
    _, plain_json, _ = check(capsys, "qwen3-next-80b-a3b", "--json")
    _, tp_json, _ = check(capsys, "qwen3-next-80b-a3b", "--tp", "1", "--json")
    added = {"tp": 1, "rank_page_bytes": 393216, "rank_swa_page_bytes": 0, "rank_slot_bytes": 77266944}
    assert json.loads(tp_json) == json.loads(plain_json) | added | {"replicated": []}


def test_a_tp_size_that_cannot_shard_exits_2_with_one_line(capsys):
    code, out, err = check(capsys, "falcon-h1-7b", "--tp", "8")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "its 12 query heads do not divide by 8" in err and "(up to 64: 1, 2, 4, 6, 12)" in err


def readme_rows() -> dict[str, list[str]]:
    lines = README.read_text().splitlines()
    start = lines.index(TABLE_HEADER) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("| `"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def expected_row(capsys, name: str) -> list[str]:
    """The README row of preset `name`, from `check --tp N --json` (page / slot per rank)."""
    cells, first_tp_of = [], {}
    for tp in (1, 2, 4, 8):
        code, out, err = check(capsys, name, "--tp", str(tp), "--json")
        if code:
            cells.append("refused: " + re.search(r": its (.*?)\. Fix", err).group(1))
            continue
        figures = json.loads(out)
        page_kib, slot_mib = figures["rank_page_bytes"] / 1024, figures["rank_slot_bytes"] / 2**20
        cells.append(f"{page_kib:g} KiB / {slot_mib:.1f} MiB")
        for part in figures["replicated"]:
            first_tp_of.setdefault(part, tp)
    by_tp: dict[int, list[str]] = {}
    for part, tp in first_tp_of.items():
        by_tp.setdefault(tp, []).append(part)
    replicated = "; ".join(f"TP {tp}+: {', '.join(parts)}" for tp, parts in by_tp.items()) or "-"
    return [*cells, replicated]


@pytest.mark.parametrize("name", preset_names())
def test_the_readme_table_is_what_check_computes(capsys, name):
    assert readme_rows()[name] == expected_row(capsys, name)
