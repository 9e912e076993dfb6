"""Generation parameters: checked when built, a seed drawn per request, which ids are banned for a
token, when a request ends and why; and a checkpoint's EOS ids."""

from __future__ import annotations

import json
import pickle

import pytest

from distpool.model.eos import eos_token_ids
from distpool.model.hf_fields import ConfigInvalid
from distpool.model.sampling import (
    Finish,
    SamplingError,
    SamplingParams,
    finish_after,
    pick_for,
    truncated,
)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 63}, "seed"),
        ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
        ({"stop_token_ids": [1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_its_field(fields, field):
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**fields)
    value = fields[field]
    assert caught.value.field == field and (caught.value.value == value or value != value)  # nan != nan
    copy = pickle.loads(pickle.dumps(caught.value))  # crosses Ray's process boundary as itself
    assert (copy.field, copy.allowed, str(copy)) == (field, caught.value.allowed, str(caught.value))


def test_defaults_are_greedy_and_a_seed_is_drawn_per_request_from_the_runs():
    params = SamplingParams(max_tokens=4)
    assert params.greedy and params.seed is None
    a, b = params.with_seed(0, "req-a"), params.with_seed(0, "req-b")
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert params.with_seed(0, "req-a") == a  # the same run gives the same seeds
    assert params.with_seed(1, "req-a").seed != a.seed
    own = SamplingParams(seed=7)
    assert own.with_seed(0, "req-a").seed == 7  # a request's own seed wins


def test_eos_and_stop_ids_are_banned_until_min_tokens_then_end_the_request():
    params = SamplingParams(max_tokens=6, min_tokens=2, stop_token_ids=(9,))
    eos = (3,)
    assert pick_for(params, eos, 0).banned == (3, 9) and pick_for(params, eos, 1).banned == (3, 9)
    assert pick_for(params, eos, 2).banned == ()
    assert finish_after(params, eos, [3]) is None  # before min_tokens: not a stop (it was banned)
    assert finish_after(params, eos, [5, 4]) is None
    assert finish_after(params, eos, [5, 4, 3]) == Finish("stop", 3)
    assert finish_after(params, eos, [5, 4, 9]) == Finish("stop", 9)
    assert finish_after(params, eos, [5, 4, 1, 1, 1, 1]) == Finish("length")
    assert truncated(params, eos, [5, 4, 1, 9, 3, 3]) == [5, 4, 1, 9]


def test_ignore_eos_keeps_stop_ids():
    params = SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(9,))
    assert pick_for(params, (3,), 0).banned == ()
    assert finish_after(params, (3,), [3]) is None
    assert finish_after(params, (3,), [3, 9]) == Finish("stop", 9)
    assert finish_after(params, (3,), [3, 3, 3, 3]) == Finish("length")


def test_eos_ids_come_from_generation_config_then_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"vocab_size": 10, "eos_token_id": 2}))
    assert eos_token_ids(config, 10) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5, 7]}))
    assert eos_token_ids(config, 10) == (7, 5)  # a list, generate's own file first
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"vocab_size": 10}))
    assert eos_token_ids(plain, 10) == ()  # a preset or the reference model's: no EOS
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 12}))
    with pytest.raises(ConfigInvalid) as refused:
        eos_token_ids(config, 10)
    facts = (refused.value.source, refused.value.field, refused.value.value)
    assert facts == (str(tmp_path / "generation_config.json"), "eos_token_id", 12)
