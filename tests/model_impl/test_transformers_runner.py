"""The transformers runner on its own (no Ray): transformers' modeling code of each supported
architecture computing through a pool, token for token equal to transformers' `generate`.

Batched decode over requests of different lengths, prefill that continues a cached prefix from its
state checkpoint (and snapshots one), state gathered and scattered once per layer per batched step,
nothing of a request kept outside the pool."""

from __future__ import annotations

import functools

import pytest
import torch

from distpool.memory.arena_pool import ArenaPool
from distpool.memory.sizing import PoolArgs, size_pools
from distpool.model_impl.hf.runner import TransformersRunner
from distpool.model_impl.prefill_job import PrefillJob
from distpool.model_impl.select import Implementation, resolve_implementation
from tests.hf_checkpoints import ARCHITECTURES, VOCAB, generate, load_for_generate
from tests.model_impl.test_prefix_prefill import decode, shared_bytes

PAGE = 4
STEPS = 5  # decode steps after the first token


@functools.cache
def _built(folder) -> tuple[Implementation, TransformersRunner]:
    impl = resolve_implementation(folder / "config.json", "transformers", dtype="float64")
    assert impl.hf is not None
    return impl, TransformersRunner(impl.spec, impl.hf)


@pytest.fixture
def runner_of(hf_checkpoints):
    return lambda arch: _built(hf_checkpoints[arch])


def pool_for(impl: Implementation) -> ArenaPool:
    args = PoolArgs(page_size=PAGE, context_len=96, enable_unified_memory=True)
    return ArenaPool(size_pools(impl.spec, args, 4 << 20), "cpu", prefix_cache=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_batched_decode_of_requests_of_different_lengths_equals_generate(runner_of, hf_checkpoints, arch):
    impl, runner = runner_of(arch)
    pool = pool_for(impl)
    prompts = [tokens(n, seed) for seed, n in enumerate((2, 9, 23))]
    before = runner.copies.gathers, runner.copies.scatters
    out = runner.generate(pool, prompts, STEPS + 1)
    oracle = load_for_generate(hf_checkpoints[arch])
    assert out == [generate(oracle, p, STEPS + 1) for p in prompts]
    # One gather and one scatter of each Mamba layer's state per batched step.
    layers = impl.spec.num_mamba_layers
    assert (runner.copies.gathers, runner.copies.scatters) == (
        before[0] + STEPS * layers,
        before[1] + STEPS * layers,
    )
    # A batch of one works on its slot in place: nothing gathered.
    alone = runner.copies.gathers
    assert runner.generate(pool, prompts[1:2], STEPS + 1) == out[1:2]
    assert runner.copies.gathers == alone
    assert pool.request_ids == [] and pool.usage()["slots"].held == pool.usage()["slots"].cached
    pool.check_invariants()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_prefill_continues_a_cached_prefix_from_its_checkpoint_and_equals_generate(
    runner_of, hf_checkpoints, arch
):
    impl, runner = runner_of(arch)
    pool = pool_for(impl)
    cache = pool.prefix_cache
    a, c = tokens(18, 1), tokens(10, 3)
    b = a[:17] + tokens(6, 2)  # shares a's first 4 pages, and one token more
    pool.reserve("a", len(a))
    handle, slot = cache.take_checkpoint()
    (done_a,) = runner.prefill(pool, [PrefillJob("a", a, snapshot=(16, slot))])  # the state after 16 tokens
    cache.cache_request("a", a, {4: handle})
    match = cache.match(b)
    checkpoint = cache.checkpoint_slot(handle)
    assert (match.num_tokens, match.checkpoint) == (16, handle)
    pool.reserve("b", len(b), prefix=match)
    pool.reserve("c", len(c))
    held = shared_bytes(pool, "b", 4, checkpoint)
    done = runner.prefill(
        pool, [PrefillJob("b", b, cached=16, checkpoint_slot=checkpoint), PrefillJob("c", c)]
    )
    assert [(d.request_id, d.computed_tokens) for d in done] == [("b", len(b) - 16), ("c", len(c))]
    assert torch.equal(shared_bytes(pool, "b", 4, checkpoint), held)  # shared pages, checkpoint: read only
    generated = decode(
        runner, pool, ["a", "b", "c"], [done_a.first_token, *(d.first_token for d in done)], STEPS
    )
    oracle = load_for_generate(hf_checkpoints[arch])
    assert generated == [generate(oracle, p, STEPS + 1) for p in (a, b, c)]
    pool.check_invariants()


def test_jamba_continues_a_checkpoint_token_by_token_because_its_scan_starts_from_zeros(runner_of):
    """transformers' Mamba1 selective scan takes no initial state: a multi-token chunk after a
    checkpoint would restart the recurrence from zeros. The runner feeds such chunks one token at a
    time; forcing one pass shows what that avoids."""
    impl, runner = runner_of("jamba")
    assert not runner.continues_in_one_pass
    prompt = tokens(14, 5)

    def state_after_prefix_then_rest(one_pass: bool) -> list[torch.Tensor]:
        pool = pool_for(impl)
        cache = pool.prefix_cache
        pool.reserve("head", 8)
        handle, slot = cache.take_checkpoint()
        runner.prefill(pool, [PrefillJob("head", prompt[:8], snapshot=(8, slot))])
        cache.cache_request("head", prompt[:8], {2: handle})
        match = cache.match(prompt)
        assert match.num_tokens == 8
        pool.reserve("x", len(prompt), prefix=match)
        runner.continues_in_one_pass = one_pass
        try:
            runner.prefill(
                pool, [PrefillJob("x", prompt, cached=8, checkpoint_slot=cache.checkpoint_slot(handle))]
            )
        finally:
            runner.continues_in_one_pass = False
        return [
            v[pool.slot_id("x")].clone() for layer in impl.spec.mamba_layers for v in pool.state_view(layer)
        ]

    pool = pool_for(impl)
    pool.reserve("full", len(prompt))
    runner.prefill(pool, [PrefillJob("full", prompt)])
    full = [v[pool.slot_id("full")] for layer in impl.spec.mamba_layers for v in pool.state_view(layer)]
    stepped, one_pass = state_after_prefix_then_rest(False), state_after_prefix_then_rest(True)

    def error(states: list[torch.Tensor]) -> float:
        return max(float((s - f).abs().max()) for s, f in zip(states, full, strict=True))

    # Token by token differs from a full prefill by rounding (its scan computes partly in float32);
    # one pass loses the checkpoint's contribution to the recurrence, 4 orders of magnitude more.
    assert error(stepped) < 1e-8 and error(one_pass) > 1e-6


def test_a_runner_serving_two_pools_in_turn_works_in_each_ones_memory(runner_of):
    """The runner keeps a pool's K/V views and slot segments between forwards; serving another pool
    rebuilds them, so nothing is read from or written to the pool it served before."""
    impl, runner = runner_of("bamba")
    first, second = pool_for(impl), pool_for(impl)
    prompts = [tokens(9, 4), tokens(3, 5)]
    served = []
    for pool, other in ((first, second), (second, first), (first, second)):
        untouched = other.buffer.clone()
        served.append(runner.generate(pool, prompts, 3))
        assert torch.equal(other.buffer, untouched)
    assert served[0] == served[1] == served[2]  # (the first test holds them against generate)
    assert bool(second.buffer.any())  # its pages and slots hold what it served
