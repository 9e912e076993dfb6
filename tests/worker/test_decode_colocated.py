"""Colocated serving on one decode worker (`--prefill 0`): a request with no kept state is prefilled
`fresh` where it decodes, from nothing, chunk by chunk between the batch's decode steps; its next
turn continues the state it left. Tokens are the oracle's (the reference model's, transformers'
`generate`), synthetic envelopes verify byte for byte, and nothing is held once the cache is dropped.
Workers are built directly: no Ray, no prefill worker, no channel."""

from __future__ import annotations

import dataclasses

import pytest

from decode.worker import DecodeWorker
from distpool.model.sampling import SamplingParams
from distpool.model_impl.reference.model import ReferenceModel
from distpool.worker.messages import DecodeFinished, LocalPrefillRefused, LocalPrefillStarted, Refusal
from distpool.worker.stats import PoolHeld
from tests.worker.test_decode_prefix_reuse import FIRST, MAX_NEW, reference_config
from tests.worker.test_synthetic_workers import synthetic_config
from tests.worker.test_workers import SPEC, assert_nothing_held, wait_finished

PROMPTS = {"a": FIRST, "b": list(range(60, 73)), "c": [5, 9, 2], "d": list(range(40, 10, -1))}
GREEDY = SamplingParams(max_tokens=MAX_NEW)


def colocated(config, chunk: int = 5) -> DecodeWorker:
    return DecodeWorker(name="decode-0", config=dataclasses.replace(config, local_prefill_chunk=chunk))


def serve_fresh(d: DecodeWorker, prompts: dict[str, list[int]]) -> dict[str, DecodeFinished]:
    """Every prompt accepted at once (they prefill while the earlier ones decode); their results."""
    for rid, prompt in prompts.items():
        assert d.local_prefill(rid, prompt, GREEDY, fresh=True) == LocalPrefillStarted(held_tokens=0)
    done = wait_finished(d, list(prompts))
    d.pool.check_invariants()
    assert set(done) == set(prompts) and all(isinstance(r, DecodeFinished) for r in done.values())
    return done


def drained(d: DecodeWorker) -> None:
    assert_nothing_held(d)  # what is left is the cache's alone
    assert d.drop_prefix_cache() == PoolHeld(pages_used=0, slots_used=0)
    d.pool.check_invariants()


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
def test_requests_with_no_kept_state_are_prefilled_from_nothing_with_the_oracles_tokens(prefix_cache):
    d = colocated(reference_config(prefix_cache=prefix_cache))
    try:
        done = serve_fresh(d, PROMPTS)
        oracle = ReferenceModel(SPEC)
        for rid, prompt in PROMPTS.items():
            assert done[rid].tokens == oracle.generate_nocache(prompt, MAX_NEW), rid
            assert done[rid].local_computed_tokens == len(prompt) and done[rid].prefix_hit_tokens == 0
            assert done[rid].received_bytes == ()  # nothing moved
        stats = d.stats()
        assert stats.local_prefills == len(PROMPTS)
        assert stats.decode_state_checkpoints == (len(PROMPTS) if prefix_cache else 0)
        drained(d)
    finally:
        d.shutdown()


def test_one_chunk_or_many_give_the_same_tokens():
    tokens = []
    for chunk in (1, 7, 512):
        d = colocated(reference_config(), chunk)
        try:
            tokens.append({rid: r.tokens for rid, r in serve_fresh(d, PROMPTS).items()})
        finally:
            d.shutdown()
    assert tokens[0] == tokens[1] == tokens[2]


def test_a_next_turn_continues_the_state_its_fresh_first_turn_left():
    d = colocated(reference_config())
    try:
        first = serve_fresh(d, {"t0": FIRST})["t0"]
        second = FIRST + first.tokens + [40, 41, 42]
        held = len(FIRST) + MAX_NEW - 1  # its reply's last token was never fed
        assert d.local_prefill("t1", second, GREEDY, fresh=True) == LocalPrefillStarted(held_tokens=held)
        done = wait_finished(d, ["t1"])["t1"]
        assert done.tokens == ReferenceModel(SPEC).generate_nocache(second, MAX_NEW)
        assert done.local_computed_tokens == len(second) - held
        drained(d)
    finally:
        d.shutdown()


def test_without_fresh_a_request_with_no_kept_state_is_still_refused():
    """Under PD the driver asks for a local prefill only where it believes a state is kept."""
    d = colocated(reference_config())
    try:
        assert isinstance(d.local_prefill("x", FIRST, GREEDY), LocalPrefillRefused)
        drained(d)
    finally:
        d.shutdown()


def test_a_fresh_request_beyond_the_room_left_is_refused_holding_nothing():
    d = colocated(reference_config(budget_bytes=96 << 10))  # a few requests of 120 tokens at once
    try:
        long = SamplingParams(max_tokens=70)
        answers = [d.local_prefill(f"r{i}", list(range(3, 53)), long, fresh=True) for i in range(12)]
        refused = [a for a in answers if isinstance(a, LocalPrefillRefused)]
        assert refused and {a.kind for a in refused} == {Refusal.NO_ROOM}
        started = [f"r{i}" for i, a in enumerate(answers) if isinstance(a, LocalPrefillStarted)]
        assert started and len(wait_finished(d, started, timeout_s=60)) == len(started)
        drained(d)
    finally:
        d.shutdown()


def test_synthetic_fresh_prefills_verify_like_transferred_envelopes():
    d = colocated(synthetic_config(), chunk=3)
    try:
        done = serve_fresh(d, {rid: [t % 50 for t in p] for rid, p in PROMPTS.items()})
        assert all(r.verified for r in done.values())
        assert (d.stats().verified_envelopes, d.stats().corrupt_envelopes) == (len(PROMPTS), 0)
        drained(d)
    finally:
        d.shutdown()


def test_the_transformers_runner_prefills_fresh_requests_as_generate(hf_checkpoints):
    from distpool.model_impl.select import resolve_implementation
    from distpool.worker.config import WorkerConfig
    from tests.hf_checkpoints import VOCAB, generate, load_for_generate

    folder = hf_checkpoints["bamba"]
    impl = resolve_implementation(folder / "config.json", "transformers", dtype="float64")
    config = WorkerConfig(
        spec=impl.spec,
        pool_args=dataclasses.replace(reference_config().pool_args, context_len=128),
        budget_bytes=8 << 20,
        model_impl="transformers",
        hf=impl.hf,
    )
    d = colocated(config, chunk=6)
    try:
        prompts = {rid: [t % VOCAB for t in p] for rid, p in PROMPTS.items()}
        done = serve_fresh(d, prompts)
        model = load_for_generate(folder)
        for rid, prompt in prompts.items():
            assert done[rid].tokens == generate(model, prompt, MAX_NEW), rid
        drained(d)
    finally:
        d.shutdown()
