"""Picking tokens: greedy is the argmax, a seeded draw depends on (seed, token index) alone, the
logits processors keep what they should, and the reference model sampled through a pool (first
token at prefill, the rest at decode) equals sampling by full recompute."""

from __future__ import annotations

import pytest
import torch

from distpool.model.hf_config import spec_from_hf
from distpool.model.sampling import SamplingParams, TokenPick, finish_after, pick_for
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.model_impl.reference.model import ReferenceModel
from distpool.model_impl.sampling import pick_one, pick_tokens, uniform_draw
from tests.fake_pool import FakePool

LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 2.9, 0.0], dtype=torch.float64)


def sampled(**fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, "temperature": 1.0, "seed": 11, **fields})


def picks(params: SamplingParams, count: int = 400) -> list[int]:
    return [pick_one(LOGITS, TokenPick(params, index)) for index in range(count)]


def test_greedy_is_the_argmax_and_a_banned_id_is_never_picked():
    assert pick_one(LOGITS, TokenPick(SamplingParams(), 0)) == 1
    assert pick_one(LOGITS, TokenPick(SamplingParams(), 0, banned=(1,))) == 4
    assert set(picks(sampled())) > {1, 4}  # sampling spreads over the likely ids
    assert 1 not in [pick_one(LOGITS, TokenPick(sampled(), i, banned=(1,))) for i in range(200)]


def test_a_draw_depends_on_the_seed_and_the_token_index_only():
    assert uniform_draw(11, 3) == uniform_draw(11, 3)
    assert len({uniform_draw(11, i) for i in range(50)}) == 50
    assert picks(sampled()) == picks(sampled())
    assert picks(sampled(seed=12)) != picks(sampled())
    # In a batch or alone, on any row: the same token for the same (seed, index).
    batch = torch.stack([LOGITS.flip(0), LOGITS])
    alone = pick_one(LOGITS, TokenPick(sampled(), 5))
    assert pick_tokens(batch, [TokenPick(sampled(seed=3), 5), TokenPick(sampled(), 5)])[1] == alone
    assert pick_tokens(batch, None) == [4, 1]


def test_top_k_then_top_p_keep_only_the_likeliest():
    assert set(picks(sampled(top_k=1))) == {1}
    assert set(picks(sampled(top_k=2))) == {1, 4}
    assert set(picks(sampled(top_p=0.01))) == {1}
    # probabilities at temperature 1: 1 (.37), 4 (.33), 2 (.22), ... ; top_p 0.6 keeps 1 and 4
    assert set(picks(sampled(top_p=0.6))) == {1, 4}
    # a low temperature sharpens: almost always the argmax
    assert picks(sampled(temperature=0.01)).count(1) == 400  # 4 is e^-10 as likely


def test_frequencies_follow_the_softmax():
    counts = torch.bincount(torch.tensor(picks(sampled(), 4000)), minlength=6).double() / 4000
    expected = torch.softmax(LOGITS, 0)
    assert torch.allclose(counts, expected, atol=0.03), (counts, expected)


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(spec_from_hf(REFERENCE_HYBRID_CONFIG), seed=0)


def generate_nocache(model: ReferenceModel, prompt: list[int], params: SamplingParams, eos=()) -> list[int]:
    """The oracle of sampled generation: full recompute per token, each picked as the pool path does."""
    tokens: list[int] = []
    while finish_after(params, eos, tokens) is None:
        logits = model.next_token_logits(prompt + tokens)
        tokens.append(pick_one(logits, pick_for(params, eos, len(tokens))))
    return tokens


def test_sampling_through_a_pool_equals_full_recompute_and_seeds_differ(model):
    pool = FakePool(model.spec, page_size=4, num_pages=64, num_slots=8)
    prompts = [[5, 17, 3, 60, 2], [9] * 13, [1, 2]]
    params = [
        SamplingParams(max_tokens=10, temperature=1.5, seed=1),
        SamplingParams(max_tokens=10, temperature=0.9, top_k=8, top_p=0.9, seed=2),
        SamplingParams(max_tokens=10, temperature=1.5, seed=3),
    ]
    got = model.generate(pool, prompts, params=params)
    assert got == [generate_nocache(model, p, q) for p, q in zip(prompts, params, strict=True)]
    other = model.generate(pool, prompts, params=[SamplingParams(max_tokens=10, temperature=1.5, seed=4)] * 3)
    assert all(a != b for a, b in zip(got, other, strict=True))  # another seed, other tokens
    assert pool.request_ids == []


def test_eos_ends_a_request_in_the_batch_and_min_tokens_and_ignore_eos_hold_it_back(model):
    pool = FakePool(model.spec, page_size=4, num_pages=64, num_slots=8)
    prompt = [5, 17, 3, 60, 2]
    greedy = model.generate_nocache(prompt, 10)
    k = next(i for i in range(2, 10) if greedy[i] not in greedy[:i])
    eos = (greedy[k],)
    params = [
        SamplingParams(max_tokens=10),  # ends at the EOS
        SamplingParams(max_tokens=10, ignore_eos=True),  # greedy to the end
        SamplingParams(max_tokens=10, min_tokens=k + 2),  # EOS banned at token k
        SamplingParams(max_tokens=10, stop_token_ids=(greedy[1],), ignore_eos=True),
    ]
    got = model.generate(pool, [prompt] * 4, params=params, eos_token_ids=eos)
    assert got[0] == greedy[: k + 1]
    assert got[1] == greedy
    assert got[2][:k] == greedy[:k] and got[2][k] != eos[0] and len(got[2]) >= k + 2
    assert got[2] == generate_nocache(model, prompt, params[2], eos)
    assert got[3] == greedy[:2]
    assert pool.request_ids == []


def test_a_nucleus_wider_than_the_first_partial_top_k_is_the_full_sorts():
    logits = torch.linspace(0, 1, 1000, dtype=torch.float64)  # nearly flat: the nucleus is hundreds
    params = sampled(top_p=0.5)
    probs = torch.softmax(logits, 0)
    ranked = torch.sort(probs, descending=True)
    size = int(((torch.cumsum(ranked.values, 0) - ranked.values) < 0.5).sum())
    assert size > 64
    nucleus = set(ranked.indices[:size].tolist())
    got = {pick_one(logits, TokenPick(params, i)) for i in range(2000)}
    assert got <= nucleus and len(got) > size // 2
