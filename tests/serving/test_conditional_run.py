"""`distpool run --conditional-disagg` end to end on the reference model: every turn after a
conversation's first is prefilled on the decode worker that holds the conversation's state, with
nothing transferred, and every turn's tokens equal the colocated oracle's (sampled too); a colocated
deployment (`--prefill 0`) serves every turn so. Bad flag values are refused before Ray starts."""

import json

import pytest

from distpool.cli import main

MULTI_TURN = ["run", "--workload", "multi-turn", "--requests", "6", "--turns", "3", "--max-new-tokens", "5"]
SMALL = ["--context-len", "4096", "--memory-gib", "0.0625", "--parity-sample", "6"]


@pytest.mark.ray
@pytest.mark.parametrize(
    "workers",
    [
        # Sampled: a local turn's first token, computed on decode, is drawn as prefill would draw it.
        ["--prefill", "1", "--decode", "1", "--temperature", "0.9", "--top-p", "0.95", "--top-k", "50"],
        ["--prefill", "2", "--decode", "2"],
    ],
    ids=["1P1D-sampled", "2P2D"],
)
def test_later_turns_are_served_locally_with_token_parity(ray_session, tmp_path, workers):
    path = tmp_path / "run.json"
    flags = ["--conditional-disagg", "--local-prefill-max-tokens", "4096", "--local-prefill-chunk", "37"]
    status = main(MULTI_TURN + workers + SMALL + flags + ["--json", str(path)])
    report = json.loads(path.read_text())
    assert status == 0, report["errors"]
    assert (report["completed"], report["parity_checked"], report["parity_mismatches"]) == (6, 6, 0)
    # Two conversations of three turns: turns 2 and 3 of each continue the state decode kept.
    assert report["local_prefills"] == 4
    assert report["decode_state_checkpoints"] == 6  # every finished turn kept its state
    assert 0 < report["local_prefill_tokens"] <= report["prefill_tokens_computed"]
    assert report["decode_prefix_hit_tokens"] > 0
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
    for figures in ("ttft_ms_by_path", "tpot_ms_by_path"):
        assert set(report[figures]) == {"remote", "local"}
        assert report[figures]["local"]["p50"] > 0 and report[figures]["remote"]["p99"] > 0


@pytest.mark.ray
def test_a_colocated_run_prefills_every_turn_where_it_decodes_with_token_parity(ray_session, tmp_path):
    """`--prefill 0`: no prefill worker, no channel; a conversation's first turn is prefilled from
    nothing on a decode worker, each later turn from the state its earlier turn left there."""
    path = tmp_path / "run.json"
    workers = ["--prefill", "0", "--decode", "2", "--local-prefill-chunk", "37"]
    status = main(MULTI_TURN + workers + SMALL + ["--json", str(path)])
    report = json.loads(path.read_text())
    assert status == 0, report["errors"]
    assert (report["deployment"], report["prefill_workers"], report["decode_workers"]) == ("colocated", 0, 2)
    assert sorted(w["name"] for w in report["workers"]) == ["decode-0", "decode-1"]
    assert (report["completed"], report["parity_checked"], report["parity_mismatches"]) == (6, 6, 0)
    assert report["local_prefills"] == 6 and report["local_prefill_fallbacks"] == 0
    assert report["local_prefill_tokens"] == report["prefill_tokens_computed"] > 0
    assert report["transfer_bytes"] == report["transfer_bytes_max"] == report["link_message_bytes"] == 0
    assert report["decode_prefix_hit_tokens"] > 0  # turns 2 and 3 continued a kept state
    assert report["ttft_ms_by_path"]["remote"] == {"p50": None, "p99": None}
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)


@pytest.mark.ray
def test_without_the_flag_every_turn_is_transferred(ray_session, tmp_path):
    path = tmp_path / "run.json"
    status = main(MULTI_TURN + SMALL + ["--no-conditional-disagg", "--json", str(path)])
    report = json.loads(path.read_text())
    assert status == 0, report["errors"]
    assert report["local_prefills"] == report["local_prefill_tokens"] == 0
    assert report["decode_state_checkpoints"] == 0  # nothing kept for a local prefill that never comes
    assert report["ttft_ms_by_path"]["local"] == {"p50": None, "p99": None}  # no request took it


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--local-prefill-max-tokens", "0"),
        ("--local-prefill-max-tokens", "many"),
        ("--local-prefill-chunk", "0"),
        ("--local-prefill-chunk", "-3"),
        ("--local-prefill-chunk", "1.5"),
    ],
)
def test_bad_values_are_refused_in_one_line_before_ray(capsys, monkeypatch, flag, value):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started for a refused flag"))
    status = main(["run", "--requests", "1", flag, value])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.count("\n") == 0 and flag in err and repr(value) in err


@pytest.mark.ray
@pytest.mark.parametrize("arch", ["bamba", "jamba"])  # one continues in one pass, one token by token
def test_the_transformers_runner_serves_a_later_turn_locally_as_generate(
    ray_session, hf_checkpoints, tmp_path, arch
):
    from tests.serving.test_transformers_runs import MULTI_TURN as TWO_TURNS
    from tests.serving.test_transformers_runs import assert_served_as_generate, serve

    flags = ["--conditional-disagg", "--local-prefill-max-tokens", "4096", "--local-prefill-chunk", "16"]
    status, report, lines = serve(hf_checkpoints[arch], tmp_path, *TWO_TURNS, *flags)
    assert status == 0, report["errors"]
    first, second = lines
    held = len(first["prompt_ids"]) + len(first["output_ids"]) - 1
    assert report["local_prefills"] == 1
    assert report["local_prefill_tokens"] == len(second["prompt_ids"]) - held
    assert_served_as_generate(hf_checkpoints[arch], report, lines)


@pytest.mark.ray
def test_a_turn_whose_state_was_evicted_falls_back_to_the_transfer(ray_session, tmp_path):
    """Decode's pool holds under two requests at full context, so serving five conversations at
    once evicts kept states while later turns are chosen for them: decode refuses those local
    prefills and the disaggregated path serves the turns, with the oracle's tokens. Decode reports
    each eviction with its next results, so no refusal comes from a view that had heard of it."""
    path = tmp_path / "run.json"
    status = main(
        ["run", "--workload", "multi-turn", "--requests", "20", "--turns", "4", "--max-new-tokens", "4"]
        + ["--context-len", "2048", "--memory-gib", "0.0009", "--parity-sample", "20", "--seed", "3"]
        + ["--conditional-disagg", "--local-prefill-max-tokens", "4096", "--json", str(path)]
    )
    report = json.loads(path.read_text())
    assert status == 0, report["errors"]
    assert report["completed"] == report["multi_turn"]["turns_planned"] and report["parity_mismatches"] == 0
    assert report["local_prefill_fallbacks"] > 0 and report["evictions"] > 0
    # Every state the driver chose a worker for was there, or its eviction was still on its way.
    assert report["stale_view_refusals"] == 0
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
