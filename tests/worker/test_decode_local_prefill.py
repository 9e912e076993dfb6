"""Local prefill on decode: a finished request leaves its final state (and its partial page) in the
decode worker's cache, and a next turn that extends it is prefilled there, chunk by chunk, from that
state, with nothing transferred. Tokens are the oracle's; synthetic envelopes verify byte for byte;
a worker that lost the state refuses, holding nothing, and the transfer path still serves the turn."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from distpool.cli.errors import error_text
from distpool.model.sampling import SamplingParams
from distpool.model_impl.reference.model import ReferenceModel
from distpool.worker.config import WorkerConfigInvalid
from distpool.worker.messages import (
    DecodeFinished,
    LocalPrefillRefused,
    LocalPrefillStarted,
    PrefillSent,
    Refusal,
)
from distpool.worker.stats import PoolHeld
from tests.worker.test_decode_prefix_reuse import FIRST, MAX_NEW, reference_config
from tests.worker.test_synthetic_workers import synthetic_config
from tests.worker.test_workers import SPEC, assert_nothing_held, make_pair, serve, wait_finished

NEW_MESSAGE = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


def chunked(config, chunk: int):
    return dataclasses.replace(config, local_prefill_chunk=chunk)


def turns_served_locally(config, num_turns: int = 3):
    """Turn 1 through the transfer, each later turn prefilled on decode: (answers, results, prompts,
    decode's stats), every pool's accounting checked after each turn."""
    p, d = make_pair(config=config)
    try:
        serve(p, d, {"t0": FIRST}, MAX_NEW)
        results, answers, prompts = [wait_finished(d, ["t0"])["t0"]], [], [FIRST]
        for turn in range(1, num_turns):
            prompt = prompts[-1] + results[-1].tokens + NEW_MESSAGE[: 3 + 4 * turn]
            rid = f"t{turn}"
            answers.append(d.local_prefill(rid, prompt, SamplingParams(max_tokens=MAX_NEW)))
            results.append(wait_finished(d, [rid])[rid])
            prompts.append(prompt)
            d.pool.check_invariants()
        assert_nothing_held(p, d)  # what decode keeps is the cache's alone
        stats = d.stats()
        assert p.drop_prefix_cache() == d.drop_prefix_cache() == PoolHeld(pages_used=0, slots_used=0)
        return answers, results, prompts, stats
    finally:
        p.shutdown()
        d.shutdown()


def test_later_turns_are_prefilled_on_decode_with_the_oracles_tokens():
    answers, results, prompts, stats = turns_served_locally(chunked(reference_config(), 3))
    oracle = ReferenceModel(SPEC)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == oracle.generate_nocache(prompt, MAX_NEW)
    # Each later turn continues the state after the earlier turn's prompt and reply but its last token.
    for answer, before, prompt, result in zip(answers, prompts[:-1], prompts[1:], results[1:], strict=True):
        held = len(before) + MAX_NEW - 1
        assert answer == LocalPrefillStarted(held_tokens=held)
        assert result.prefix_hit_tokens == held and result.local_computed_tokens == len(prompt) - held
    assert results[0].local_computed_tokens == 0  # the first turn was transferred
    # Three finished requests kept their state; each superseded the one before: one is left.
    assert stats.decode_state_checkpoints == 3 and stats.checkpoints == 1
    assert stats.local_prefills == 2


def test_a_whole_prompt_in_one_chunk_gives_the_same_tokens():
    _, small, _, _ = turns_served_locally(chunked(reference_config(), 2))
    _, large, _, _ = turns_served_locally(chunked(reference_config(), 512))
    assert [r.tokens for r in small] == [r.tokens for r in large]


def test_synthetic_local_prefills_verify_like_transferred_envelopes():
    answers, results, _, stats = turns_served_locally(chunked(synthetic_config(), 5))
    assert all(isinstance(a, LocalPrefillStarted) for a in answers)
    assert all(isinstance(r, DecodeFinished) and r.verified for r in results)
    # Every envelope, transferred or prefilled here, verified on arrival and at release.
    assert (stats.verified_envelopes, stats.corrupt_envelopes) == (3, 0)


def test_a_worker_that_lost_the_state_refuses_and_the_transfer_serves_the_turn():
    p, d = make_pair(config=reference_config())
    try:
        serve(p, d, {"t0": FIRST}, MAX_NEW)
        first = wait_finished(d, ["t0"])["t0"]
        second = FIRST + first.tokens + NEW_MESSAGE
        d.pool.prefix_cache.final_states.evict(1)  # as making room for others would
        answer = d.local_prefill("t1", second, SamplingParams(max_tokens=MAX_NEW))
        assert isinstance(answer, LocalPrefillRefused) and answer.kind is Refusal.NO_STATE
        assert_nothing_held(p, d)
        d.pool.check_invariants()
        assert isinstance(serve(p, d, {"t1": second}, MAX_NEW)["t1"], PrefillSent)
        done = wait_finished(d, ["t1"])["t1"]
        assert done.tokens == ReferenceModel(SPEC).generate_nocache(second, MAX_NEW)
        assert done.local_computed_tokens == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_a_prompt_that_does_not_extend_a_kept_state_is_refused():
    p, d = make_pair(config=reference_config())
    try:
        serve(p, d, {"t0": FIRST}, MAX_NEW)
        wait_finished(d, ["t0"])
        answer = d.local_prefill("other", [7] + FIRST, SamplingParams(max_tokens=MAX_NEW))
        assert isinstance(answer, LocalPrefillRefused)
        assert_nothing_held(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_without_local_prefill_decode_keeps_no_state_and_refuses():
    """`--no-conditional-disagg`: no slot copy per finished request, nothing kept to continue from."""
    p, d = make_pair(config=dataclasses.replace(reference_config(), local_prefill=False))
    try:
        serve(p, d, {"t0": FIRST}, MAX_NEW)
        first = wait_finished(d, ["t0"])["t0"]
        assert d.pool.prefix_cache is not None and d.pool.prefix_cache.final_states is None
        assert d.stats().decode_state_checkpoints == 0
        answer = d.local_prefill("t1", FIRST + first.tokens + NEW_MESSAGE, SamplingParams(max_tokens=MAX_NEW))
        assert isinstance(answer, LocalPrefillRefused)
        assert_nothing_held(p, d)
        d.pool.check_invariants()
    finally:
        p.shutdown()
        d.shutdown()


def test_a_worker_configuration_out_of_range_is_refused_with_its_field_and_value():
    """The worker layer states the facts (the field, the value, what it must be); the command line
    names the flag (`distpool.cli.errors`)."""
    config = reference_config()
    for field, value in (("local_prefill_chunk", 0), ("device", "cpu:1"), ("device", "bogus")):
        with pytest.raises(WorkerConfigInvalid) as refused:
            dataclasses.replace(config, **{field: value})
        assert (refused.value.field, refused.value.value) == (field, value)
        again = pickle.loads(pickle.dumps(refused.value))
        assert (again.field, again.value, again.expected) == (field, value, refused.value.expected)
        assert error_text(refused.value).startswith("--" + field.replace("_", "-") + " must be ")
