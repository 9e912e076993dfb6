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
    assert report["model_impl"] == "transformers" and report["dtype"] == "float64"
    assert report["parity_mismatches"] == report["parity_near_ties"] == 0
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
    model = load_for_generate(folder)
    for line in lines:
        assert len(line["output_ids"]) == MAX_NEW_TOKENS
        assert line["output_ids"] == generate(model, line["prompt_ids"], MAX_NEW_TOKENS), line["id"]


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
    assert second["prompt_ids"][len(first["prompt_ids"]) :][:MAX_NEW_TOKENS] == first["output_ids"]
    # Prefill started turn 2 from the checkpoint turn 1 left at the deepest boundary a later prompt
    # can start from (its 268 tokens but the last page: 264) and computed only the rest; decode held
    # turn 1's full pages (its prompt and reply but the last token, which has no KV yet).
    assert len(first["prompt_ids"]) == 268
    assert report["prefix_hit_tokens"] == 264
    assert report["prefill_tokens_computed"] == 268 + len(second["prompt_ids"]) - 264
    assert report["decode_prefix_hit_tokens"] == (268 + MAX_NEW_TOKENS - 1) // 4 * 4
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
