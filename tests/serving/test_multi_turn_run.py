"""`distpool run --workload multi-turn` end to end on the reference model: every turn goes through
PD, and the prompts the turns were actually served with (each carrying the earlier replies) give
the same tokens colocated. Prefix caches on both sides are used, and reported."""

import json

import pytest

from distpool.cli import main

pytestmark = pytest.mark.ray


def test_multi_turn_run_serves_every_turn_and_parity_holds(ray_session, tmp_path):
    path, outputs = tmp_path / "run.json", tmp_path / "outputs.jsonl"
    status = main(
        ["run", "--workload", "multi-turn", "--requests", "4", "--turns", "2", "--max-new-tokens", "6"]
        + ["--decode", "2", "--outputs", str(outputs)]
        + ["--context-len", "4096", "--memory-gib", "0.0625", "--parity-sample", "4", "--json", str(path)]
    )
    report = json.loads(path.read_text())
    assert status == 0, report["errors"]
    # --outputs: every turn as served, its whole prompt (a later turn carries the earlier reply)
    lines = {line["id"]: line for line in map(json.loads, outputs.read_text().splitlines())}
    assert sorted(lines) == ["conv-00000-t000", "conv-00000-t001", "conv-00001-t000", "conv-00001-t001"]
    for conversation in ("conv-00000", "conv-00001"):
        first, second = lines[f"{conversation}-t000"], lines[f"{conversation}-t001"]
        assert len(first["output_ids"]) == len(second["output_ids"]) == 6
        turn_one = first["prompt_ids"] + first["output_ids"]
        assert second["prompt_ids"][: len(turn_one)] == turn_one
    assert report["multi_turn"] == {
        "conversations": 2,
        "conversations_completed": 2,
        "turns_per_conversation": 2,
        "turns_asked": 4,
        "turns_cut_by_context": 0,
        "turns_planned": 4,
        "turns_served": 4,
        "turns_completed": 4,
        "turns_skipped": 0,
    }
    assert (report["requests"], report["completed"], report["tokens_generated"]) == (4, 4, 24)
    assert (report["parity_checked"], report["parity_mismatches"]) == (4, 0)
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
    # Turn 2 starts with turn 1's prompt: prefill found its full pages (and the state checkpoint
    # taken at turn 1's last page boundary) cached, and computed only the rest. Parity above shows
    # the tokens are those of a full computation.
    assert report["prefix_hit_tokens"] >= 2 * 48  # two conversations, turn 1 of >= 64 tokens
    assert report["prefill_tokens_computed"] > 0 and report["checkpoints"] >= 2
    assert report["cached_pages"] >= 2 * 4
    # Each turn 2 went to the decode worker that served its turn 1 (cache-aware routing; with two
    # decode workers, load order alone could send it to the other one), which held turn 1's prompt
    # and reply in full pages: the transfer skipped at least the >= 64 prompt tokens' pages.
    assert report["decode_prefix_hit_tokens"] >= 2 * 64
    decode_cached = [w["cached_pages"] for w in report["workers"] if w["role"] == "decode"]
    assert len(decode_cached) == 2 and sum(decode_cached) >= 2 * 4
