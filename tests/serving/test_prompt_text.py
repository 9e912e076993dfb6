"""Text in, text out: a model folder holding a tokenizer tokenizes the `{"prompt": "text"}` lines of a
prompts file with it, and `--outputs` adds each output's text; without one, text prompts are UTF-8
bytes modulo the vocabulary and outputs carry ids only. The tokenizer is built at test time."""

from __future__ import annotations

import json
import shutil

import pytest

from distpool.cli import main
from distpool.model.presets import resolve_model
from distpool.model.sampling import SamplingParams
from distpool.model_impl.hf.tokenizer import find_tokenizer
from distpool.serving.job.main import outputs_text
from distpool.serving.outcome import Outcome
from distpool.serving.workloads.workload import Request, load_jsonl
from tests.hf_checkpoints import VOCAB, save_tokenizer


@pytest.fixture
def folder(hf_checkpoints, tmp_path):
    """The tiny Bamba config (no weights) in a folder of its own, with a word-level tokenizer."""
    own = tmp_path / "bamba"
    own.mkdir()
    shutil.copy(hf_checkpoints["bamba"] / "config.json", own / "config.json")
    return save_tokenizer(own)


def write_prompts(path, *rows: dict):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_text_prompts_are_tokenized_with_the_folders_tokenizer(folder, tmp_path):
    tokenizer = find_tokenizer(folder / "config.json")
    assert tokenizer is not None and tokenizer.folder == str(folder)
    prompts = write_prompts(
        tmp_path / "prompts.jsonl", {"id": "t", "prompt": "the cat sat on the mat"}, {"prompt_ids": [5, 6]}
    )
    text, ids = load_jsonl(prompts, vocab_size=VOCAB, max_new_tokens=4, tokenizer=tokenizer)
    # <s> first (the tokenizer's BOS), then one id per word: the 2, cat 4, sat 6, on 7, mat 8
    assert text == Request(request_id="t", prompt=[1, 2, 4, 6, 7, 2, 8], params=SamplingParams(max_tokens=4))
    assert ids.prompt == [5, 6]
    # Without a tokenizer: the text's UTF-8 bytes modulo the vocabulary, as before.
    (bytes_request, _) = load_jsonl(prompts, vocab_size=VOCAB, max_new_tokens=4)
    assert bytes_request.prompt == [b % VOCAB for b in b"the cat sat on the mat"]


def test_outputs_add_the_text_of_the_generated_ids_with_a_tokenizer(folder):
    tokenizer = find_tokenizer(folder / "config.json")
    served = [
        Request("a", [1, 3], SamplingParams(max_tokens=3)),
        Request("b", [1, 4], SamplingParams(max_tokens=3)),
    ]
    outcomes = [Outcome(request_id="a", tokens=[4, 1, 6]), Outcome(request_id="b", tokens=None)]
    (line,) = [json.loads(x) for x in outputs_text(served, outcomes, tokenizer.decode).splitlines()]
    assert line == {"id": "a", "prompt_ids": [1, 3], "output_ids": [4, 1, 6], "text": "cat sat"}
    assert "text" not in json.loads(outputs_text(served, outcomes))  # no tokenizer: ids only


def test_presets_loose_configs_and_folders_without_tokenizer_files_have_none(folder, tmp_path):
    assert find_tokenizer(resolve_model("nemotron-h-8b")) is None
    loose = tmp_path / "loose.json"
    shutil.copy(folder / "config.json", loose)
    assert find_tokenizer(loose) is None
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    assert find_tokenizer(folder / "config.json") is None


def test_token_ids_outside_the_models_vocabulary_are_refused_naming_the_line(folder, tmp_path):
    tokenizer = find_tokenizer(folder / "config.json")
    prompts = write_prompts(
        tmp_path / "prompts.jsonl", {"prompt_ids": [1]}, {"prompt": "the sun and the star"}
    )
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: the tokenizer in .* gives token id 20, outside"):
        load_jsonl(prompts, vocab_size=20, max_new_tokens=4, tokenizer=tokenizer)


def test_run_refuses_a_tokenizer_it_cannot_load_before_ray_starts(folder, tmp_path, capsys):
    (folder / "tokenizer.json").write_text("{not json")
    prompts = write_prompts(tmp_path / "prompts.jsonl", {"prompt": "the cat"})
    args = ["run", "--model", str(folder), "--model-impl", "synthetic", "--prompts", str(prompts)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{folder} holds tokenizer files" in err and "Fix: repair or remove them" in err
