"""`distpool run` with transformers' own modeling code in the pools, end to end on each of the six
supported architectures: a tiny seeded checkpoint saved at test time, 1P1D, float64. The served
output ids (`--outputs`) equal transformers' `generate` on each served prompt, token for token; the
run's own parity check agrees; nothing leaks. The multi-turn run's second turn continues a cached
prefix from its state checkpoint at prefill and reuses the pages decode held."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from distpool.cli import main
from distpool.model.eos import eos_token_ids
from distpool.model.sampling import SamplingParams, finish_after, truncated
from tests.hf_checkpoints import ARCHITECTURES, VOCAB, generate, load_for_generate, save_tokenizer

pytestmark = pytest.mark.ray

MAX_NEW_TOKENS = 5
PROMPT_LENGTHS = (3, 17, 30)  # under, across and well past a 4-token page
# One conversation of two turns: 268 prompt tokens, then those, the 5 replied and 78 new (seed 85).
MULTI_TURN = ["--workload", "multi-turn", "--requests", "2", "--turns", "2", "--seed", "85"]


def serve(folder, tmp_path, *extra: str) -> tuple[int, dict, list[dict]]:
    report, outputs = tmp_path / "run.json", tmp_path / "outputs.jsonl"
    status = main(
        ["run", "--model", str(folder), "--model-impl", "transformers", "--dtype", "float64"]
        + ["--page-size", "4", "--context-len", "384", "--memory-gib", "0.03125"]
        + ["--max-new-tokens", str(MAX_NEW_TOKENS), "--parity-sample", "3"]
        + ["--json", str(report), "--outputs", str(outputs), *extra]
    )
    lines = [json.loads(line) for line in outputs.read_text().splitlines()]
    return status, json.loads(report.read_text()), lines


def assert_served_as_generate(folder, report: dict, lines: list[dict]) -> None:
    """Each served reply is generate's, cut at the checkpoint's first EOS id (where the served one
    ended, saying so)."""
    assert report["model_impl"] == "transformers" and report["dtype"] == "float64"
    assert report["parity_mismatches"] == report["parity_near_ties"] == 0
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
    model = load_for_generate(folder)
    greedy, eos = SamplingParams(max_tokens=MAX_NEW_TOKENS), eos_token_ids(folder / "config.json", VOCAB)
    for line in lines:
        expected = truncated(greedy, eos, generate(model, line["prompt_ids"], MAX_NEW_TOKENS))
        assert line["output_ids"] == expected, line["id"]
        assert line["finish_reason"] == finish_after(greedy, eos, expected).reason


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_prompts_served_through_the_pools_equal_generate(ray_session, hf_checkpoints, tmp_path, arch):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{n}", "prompt_ids": [(7 * i + n) % VOCAB for i in range(n)]} for n in PROMPT_LENGTHS]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    status, report, lines = serve(hf_checkpoints[arch], tmp_path, "--prompts", str(prompts))
    assert status == 0, report["errors"]
    assert [line["id"] for line in lines] == [row["id"] for row in rows]
    assert [line["prompt_ids"] for line in lines] == [row["prompt_ids"] for row in rows]
    assert (report["completed"], report["parity_checked"]) == (3, 3)
    assert_served_as_generate(hf_checkpoints[arch], report, lines)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_multi_turn_conversation_continues_cached_prefixes_and_equals_generate(
    ray_session, hf_checkpoints, tmp_path, arch
):
    # The disaggregated path: turn 2 prefilled on prefill from its checkpoint (not on decode).
    status, report, lines = serve(hf_checkpoints[arch], tmp_path, *MULTI_TURN, "--no-conditional-disagg")
    assert status == 0, report["errors"]
    assert report["multi_turn"]["turns_completed"] == 2 and len(lines) == 2
    first, second = lines
    assert second["prompt_ids"][: len(first["prompt_ids"])] == first["prompt_ids"]
    reply = first["output_ids"]  # cut short where the checkpoint's EOS ended it (jamba's)
    assert second["prompt_ids"][len(first["prompt_ids"]) :][: len(reply)] == reply
    # Prefill started turn 2 from the checkpoint turn 1 left at the deepest boundary a later prompt
    # can start from (its 268 tokens but the last page: 264) and computed only the rest; decode held
    # turn 1's full pages (its prompt and reply but the last token, which has no KV yet).
    assert len(first["prompt_ids"]) == 268
    assert report["prefix_hit_tokens"] == 264
    assert report["prefill_tokens_computed"] == 268 + len(second["prompt_ids"]) - 264
    assert report["decode_prefix_hit_tokens"] == (268 + len(reply) - 1) // 4 * 4
    assert report["parity_checked"] == 2
    assert_served_as_generate(hf_checkpoints[arch], report, lines)


def test_text_prompts_are_served_with_the_checkpoints_tokenizer_and_come_back_as_text(
    ray_session, hf_checkpoints, tmp_path
):
    folder = save_tokenizer(shutil.copytree(hf_checkpoints["qwen3_next"], tmp_path / "with-tokenizer"))
    texts = {"short": "the cat", "long": "the big red dog ran to the old house under the blue sky and sleeps"}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in texts.items()))
    status, report, lines = serve(folder, tmp_path, "--prompts", str(prompts))
    assert status == 0, report["errors"]
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)  # transformers' own
    assert [line["prompt_ids"] for line in lines] == [tokenizer.encode(text) for text in texts.values()]
    assert [line["text"] for line in lines] == [
        tokenizer.decode(line["output_ids"], skip_special_tokens=True) for line in lines
    ]
    assert all(line["text"] for line in lines)  # words, not only special tokens
    assert_served_as_generate(folder, report, lines)


def test_seeded_sampling_stop_ids_and_a_checkpoints_eos_served_1p1d(ray_session, hf_checkpoints, tmp_path):
    """The runner, 1P1D, one --prompts run: a checkpoint whose generate config names an EOS id its
    greedy reply reaches ends there (finish_reason stop) where generate, run on, goes past it; stop
    ids, min_tokens and ignore_eos; sampled requests equal the colocated oracle (our own colocated
    path: generate draws otherwise), and another seed gives other tokens."""
    folder = shutil.copytree(hf_checkpoints["bamba"], tmp_path / "bamba-eos")
    prompt, max_tokens = [(5 * i + 3) % VOCAB for i in range(11)], 8
    greedy = generate(load_for_generate(folder), prompt, max_tokens)
    eos_at = next(i for i in range(1, max_tokens) if greedy[i] not in greedy[:i])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [greedy[eos_at]]}))
    sampled = {"temperature": 1.5, "top_k": 32, "ignore_eos": True}
    rows = {
        "eos": {},
        "ignore-eos": {"ignore_eos": True},
        "min-tokens": {"min_tokens": eos_at + 2},
        "stop-id": {"stop_token_ids": [greedy[0]]},
        "seed-1": {**sampled, "seed": 1},
        "seed-2": {**sampled, "seed": 2},
        "run-seed": {"temperature": 0.8, "top_p": 0.9},
    }
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": k, "prompt_ids": prompt, "max_tokens": max_tokens, **v}) + "\n"
            for k, v in rows.items()
        )
    )
    status, report, lines = serve(folder, tmp_path, "--prompts", str(prompts), "--parity-sample", "7")
    assert status == 0, report["errors"]
    assert (report["completed"], report["parity_checked"], report["parity_mismatches"]) == (7, 7, 0)
    out = {line["id"]: line for line in lines}
    assert out["eos"]["output_ids"] == greedy[: eos_at + 1] and out["eos"]["finish_reason"] == "stop"
    assert out["eos"]["stop_token_id"] == greedy[eos_at]
    assert out["ignore-eos"]["output_ids"] == greedy and out["ignore-eos"]["finish_reason"] == "length"
    assert out["min-tokens"]["output_ids"][:eos_at] == greedy[:eos_at]
    assert len(out["min-tokens"]["output_ids"]) >= eos_at + 2
    assert out["stop-id"]["output_ids"] == greedy[:1]  # its first token, prefill's, ended it
    assert out["seed-1"]["output_ids"] != out["seed-2"]["output_ids"]
    assert report["finish_reasons"]["stop"] >= 2 and report["finish_reasons"]["length"] >= 2
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)


def test_seeded_sampling_2p2d_with_faults_and_a_local_turn(ray_session, hf_checkpoints, tmp_path):
    """The runner, 2P2D, transfers aborted at random (seed 1 aborts the first attempt), sampled
    multi-turn conversations whose second turns are prefilled on decode: every turn's tokens equal
    the colocated oracle's."""
    status, report, _ = serve(
        hf_checkpoints["bamba"],
        tmp_path,
        *["--workload", "multi-turn", "--requests", "4", "--turns", "2", "--seed", "1"],
        *["--prefill", "2", "--decode", "2", "--fault-rate", "0.2", "--context-len", "1024"],
        *["--temperature", "0.9", "--top-p", "0.95", "--parity-sample", "4", "--memory-gib", "0.0625"],
        *["--conditional-disagg", "--local-prefill-max-tokens", "4096"],
    )
    assert status == 0, report["errors"]
    assert (report["completed"], report["parity_checked"], report["parity_mismatches"]) == (4, 4, 0)
    assert report["retried"] >= 1 and report["local_prefills"] >= 1
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
