"""Prefill's prefix cache on what users share most: identical prompts and one system prompt.

A hybrid Mamba prefix is usable only where a state checkpoint was written. Once each prefill wrote
one at its own last page boundary only: 48 identical 64-token prompts hit nothing (a match must
leave a token to compute) and prompts behind one system prompt hit nothing either (the checkpoint
lay past the shared part). Tokens stay those of the no-cache oracle, and every byte verifies.
"""

from __future__ import annotations

import pytest

from distpool.model_impl.reference.model import ReferenceModel
from distpool.worker.messages import DecodeFinished, PrefillSent
from distpool.worker.stats import PoolHeld
from tests.worker.test_synthetic_workers import synthetic_config
from tests.worker.test_workers import ARGS, SPEC, assert_nothing_held, make_pair, serve, wait_finished

PAGE = ARGS.page_size  # 4 tokens (the synthetic config's too)
MAX_NEW = 3
SYSTEM = [(7 * t + 5) % 90 for t in range(22)]  # 5 full pages and 2 tokens


def user(i: int) -> list[int]:
    return [(11 * i + t) % 90 + 1 for t in range(9)]  # differs from every other user's first token


def serve_batches(
    config, batches: list[dict[str, list[int]]]
) -> tuple[dict[str, int], dict[str, list[int]], dict]:
    """Serve each batch of {request id: prompt} as one prefill call on one pair, in order: prompt
    tokens each request found cached at prefill, its generated tokens, and the prefill stats."""
    p, d = make_pair(config=config)
    try:
        hits, tokens = {}, {}
        for prompts in batches:
            sent = serve(p, d, prompts, MAX_NEW)
            assert {type(r) for r in sent.values()} == {PrefillSent}
            # The model's rate of the request's wave: measured wherever it computed anything.
            assert all((r.compute_tokens_per_s > 0) == (r.computed_tokens > 0) for r in sent.values())
            hits |= {rid: len(prompts[rid]) - r.computed_tokens for rid, r in sent.items()}
            done = wait_finished(d, list(prompts))
            assert {type(r) for r in done.values()} == {DecodeFinished}, done
            tokens |= {rid: r.tokens for rid, r in done.items()}
        assert_nothing_held(p, d)
        stats = p.stats()
        assert p.drop_prefix_cache() == PoolHeld(pages_used=0, slots_used=0)
        return hits, tokens, stats
    finally:
        p.shutdown()
        d.shutdown()


def oracle(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    model = ReferenceModel(SPEC)
    return {rid: model.generate_nocache(prompt, MAX_NEW) for rid, prompt in prompts.items()}


def test_identical_whole_page_prompts_hit_all_but_their_last_page_across_batches():
    prompt = list(range(1, 17))  # 16 tokens: exactly 4 pages
    batches = [{f"r{i}": prompt} for i in range(3)]
    hits, tokens, _ = serve_batches(None, batches)
    assert hits == {"r0": 0, "r1": 12, "r2": 12}  # a match leaves the last page to compute
    assert tokens == oracle({f"r{i}": prompt for i in range(3)})


def test_identical_prompts_in_one_batch_wait_for_the_first_and_hit():
    prompt = list(range(1, 17))
    batch = {f"r{i}": prompt for i in range(4)}
    hits, tokens, stats = serve_batches(None, [batch])
    assert hits == {"r0": 0, "r1": 12, "r2": 12, "r3": 12}
    assert tokens == oracle(batch)
    assert stats.checkpoints == 1  # one checkpoint serves all three


def test_prompts_behind_one_system_prompt_hit_it_from_the_second_batch_on():
    """r0 leaves nothing shared; r1 leaves r0's cached path after the system prompt's 5 full pages
    and writes its checkpoint there; every later request hits those 20 tokens."""
    prompts = {f"r{i}": SYSTEM + user(i) for i in range(5)}
    batches = [{"r0": prompts["r0"]}, {"r1": prompts["r1"]}, {r: prompts[r] for r in ("r2", "r3", "r4")}]
    hits, tokens, _ = serve_batches(None, batches)
    assert hits == {"r0": 0, "r1": 0, "r2": 20, "r3": 20, "r4": 20}
    assert tokens == oracle(prompts)


@pytest.mark.parametrize("cache", ["reference", "synthetic"])
def test_one_batch_behind_one_system_prompt_shares_it_through_its_first_request(cache):
    prompts = {f"r{i}": SYSTEM + user(i) for i in range(4)}
    config = synthetic_config() if cache == "synthetic" else None
    hits, tokens, stats = serve_batches(config, [prompts])
    assert hits == {"r0": 0, "r1": 20, "r2": 20, "r3": 20}
    if cache == "reference":
        assert tokens == oracle(prompts)
    # r0's checkpoint at the system prompt, then r1..r3's own ends (7 full pages usable each)
    assert stats.checkpoints == 4
