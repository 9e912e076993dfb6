"""`distpool run` with generation parameters on the reference model, 2P2D with transfers aborted at
random: sampled requests (their own seeds, or drawn from the run's), a checkpoint's EOS id, stop ids,
min_tokens and ignore_eos, each served with the colocated oracle's tokens, token for token, however
often its transfer was retried; bad values are refused before Ray starts. (1P1D with a local turn:
test_conditional_run.py; TP 2 -> 1: test_tp_serving.py; the transformers runner:
test_transformers_runs.py.)"""

from __future__ import annotations

import json
import shutil

import pytest

from distpool.cli import main
from distpool.model.hf_config import spec_from_hf
from distpool.model.sampling import SamplingParams, stop_ids
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.model_impl.reference.model import ReferenceModel
from tests.model_impl.test_sampling import generate_nocache

MAX_TOKENS = 10
PROMPT = [5, 17, 3, 60, 2, 44, 9]
RUN_SEED = 3  # the workers' weights, the injected faults, and the seeds drawn for requests without one
ORACLE = ReferenceModel(spec_from_hf(REFERENCE_HYBRID_CONFIG), seed=RUN_SEED)
GREEDY = ORACLE.generate_nocache(PROMPT, MAX_TOKENS)
EOS_AT = next(i for i in range(2, MAX_TOKENS) if GREEDY[i] not in GREEDY[:i])
EOS = GREEDY[EOS_AT]
SAMPLED = {"temperature": 1.3, "top_k": 40, "top_p": 0.95}
LINES = {
    "greedy-eos": {},
    "ignore-eos": {"ignore_eos": True},
    "min-tokens": {"min_tokens": EOS_AT + 2},
    "stop-id": {"stop_token_ids": [GREEDY[1]], "ignore_eos": True},
    "seed-1": {**SAMPLED, "seed": 1, "ignore_eos": True},
    "seed-2": {**SAMPLED, "seed": 2, "ignore_eos": True},
    "run-seed-a": {**SAMPLED},
    "run-seed-b": {**SAMPLED, "max_tokens": 7},
}


def reference_with_eos(tmp_path):
    """The bundled reference model, its generate config naming EOS (and one id it never reaches)."""
    folder = tmp_path / "reference-eos"
    folder.mkdir()
    shutil.copy(REFERENCE_HYBRID_CONFIG, folder / "config.json")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 95]}))
    return folder


@pytest.mark.ray
def test_sampled_requests_under_2p2d_with_faults_equal_the_colocated_oracle(ray_session, tmp_path):
    prompts, report_path, outputs = tmp_path / "prompts.jsonl", tmp_path / "run.json", tmp_path / "out.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": rid, "prompt_ids": PROMPT, **f}) + "\n" for rid, f in LINES.items())
    )
    status = main(
        ["run", "--model", str(reference_with_eos(tmp_path)), "--prefill", "2", "--decode", "2"]
        + ["--prompts", str(prompts), "--max-new-tokens", str(MAX_TOKENS)]
        + ["--fault-rate", "0.2", "--seed", str(RUN_SEED)]
        + ["--memory-gib", "0.0625", "--parity-sample", str(len(LINES))]
        + ["--json", str(report_path), "--outputs", str(outputs)]
    )
    report = json.loads(report_path.read_text())
    assert status == 0, report["errors"]
    assert (report["completed"], report["parity_checked"], report["parity_mismatches"]) == (8, 8, 0)
    assert report["retried"] > 0  # some first tokens were sampled again on a retried transfer
    lines = {line["id"]: line for line in map(json.loads, outputs.read_text().splitlines())}
    out = {rid: line["output_ids"] for rid, line in lines.items()}
    assert out["greedy-eos"] == GREEDY[: EOS_AT + 1]
    assert (lines["greedy-eos"]["finish_reason"], lines["greedy-eos"]["stop_token_id"]) == ("stop", EOS)
    assert out["ignore-eos"] == GREEDY and lines["ignore-eos"]["finish_reason"] == "length"
    assert out["stop-id"] == GREEDY[:2] and lines["stop-id"]["stop_token_id"] == GREEDY[1]
    assert out["seed-1"] != out["seed-2"]  # the same prompt, another seed
    assert lines["seed-1"]["seed"] == 1 and lines["run-seed-a"]["seed"] != lines["run-seed-b"]["seed"]
    for rid, fields in LINES.items():  # served as the oracle computes them, with the seed reported
        params = SamplingParams(
            **{"max_tokens": MAX_TOKENS, **fields, "seed": lines[rid]["seed"]} | _tuple(fields)
        )
        assert out[rid] == generate_nocache(ORACLE, PROMPT, params, (EOS, 95)), rid
        assert not set(out[rid][:-1]) & set(stop_ids(params, (EOS, 95)))  # none made before its end
    reasons = report["finish_reasons"]
    assert reasons == {
        "stop": sum(line["finish_reason"] == "stop" for line in lines.values()),
        "length": reasons["length"],
    }
    assert reasons["stop"] >= 2 and reasons["length"] >= 2
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)


def _tuple(fields: dict) -> dict:
    return {"stop_token_ids": tuple(fields["stop_token_ids"])} if "stop_token_ids" in fields else {}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p must be a number in (0, 1]"),
        (["--top-k", "-3"], "--top-k must be a whole number >= 0"),
        (["--temperature", "nan"], "--temperature must be"),
    ],
)
def test_bad_run_wide_values_exit_2_naming_the_flag(flags, message, capsys):
    assert main(["run", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"top_p": 2}, "top_p must be a number in (0, 1]"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens must be a whole number in [0, max_tokens=3]"),
        ({"seed": "x"}, "seed must be a whole number"),
        ({"stop_token_ids": [500]}, "stop_token_ids must be token ids in [0, 96)"),
        ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
        ({"max_tokens": 3, "max_new_tokens": 3}, "max_tokens and max_new_tokens both given"),
        ({"max_tokens": 100000}, "2 prompt tokens and 100000 new tokens are longer than --context-len"),
    ],
)
def test_bad_values_in_a_prompts_line_exit_2_naming_the_line(fields, message, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2], **fields}) + "\n")
    assert main(["run", "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{prompts}:1: {message}" in err and len(err.splitlines()) == 1
