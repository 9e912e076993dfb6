"""The reference hybrid model: cached generation through a pool equals full recompute, token for token."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from distpool.memory.arena_pool import build_pool
from distpool.memory.pool import DoesNotFit
from distpool.memory.sizing import PoolArgs, size_pools
from distpool.model.hf_config import spec_from_hf
from distpool.model_impl.errors import (
    DUPLICATE_REQUEST,
    EMPTY_PROMPT,
    NOT_EXTENDED,
    NOT_MAMBA2_HYBRID,
    TOKENS_NOT_RESERVED,
    TOO_LARGE,
    BatchRefused,
    ImplCannotRun,
    TokenIdsOutOfRange,
)
from distpool.model_impl.reference.attention import AttentionLayer
from distpool.model_impl.reference.configs import (
    REFERENCE_DENSE_CONFIG,
    REFERENCE_HYBRID_CONFIG,
    REFERENCE_SWA_CONFIG,
)
from distpool.model_impl.reference.mamba2 import Mamba2Layer
from distpool.model_impl.reference.model import ReferenceModel
from distpool.model_impl.reference.support import check_supported, unsupported_reason
from tests.factories import FIXTURES, free_units, prefill_tokens
from tests.fake_pool import FakePool

PROMPT_LENGTHS = (1, 5, 16, 17, 33)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(spec_from_hf(REFERENCE_HYBRID_CONFIG), seed=0)


@pytest.fixture(scope="module")
def prompts(model: ReferenceModel) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(model.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def oracle(model: ReferenceModel, prompts: list[list[int]]) -> list[list[int]]:
    return [model.generate_nocache(prompt, NEW_TOKENS) for prompt in prompts]


def make_pool(model: ReferenceModel, *, page_size: int, num_pages: int = 64, num_slots: int = 8) -> FakePool:
    return FakePool(model.spec, page_size=page_size, num_pages=num_pages, num_slots=num_slots)


def assert_all_free(pool: FakePool) -> None:
    pool.check_invariants()
    assert pool.request_ids == []
    assert sorted(pool.free_pages) == list(range(pool.num_pages))
    assert sorted(pool.free_slots) == list(range(pool.num_slots))


def test_bundled_hybrid_config_follows_the_mamba2_state_convention(model: ReferenceModel) -> None:
    config = json.loads(REFERENCE_HYBRID_CONFIG.read_text())
    spec = model.spec
    assert spec.architectures == ("NemotronHForCausalLM",)
    assert spec.num_layers == len(config["hybrid_override_pattern"]) == config["num_hidden_layers"]
    pattern = config["hybrid_override_pattern"]
    assert spec.full_attention_layers == tuple(i for i, c in enumerate(pattern) if c == "*")
    assert spec.mamba_layers == tuple(i for i, c in enumerate(pattern) if c == "M")
    intermediate = config["mamba_num_heads"] * config["mamba_head_dim"]
    conv_dim = intermediate + 2 * config["n_groups"] * config["ssm_state_size"]
    conv, ssm = spec.mamba.tensors
    assert conv.shape == (conv_dim, config["conv_kernel"] - 1)
    assert ssm.shape == (config["mamba_num_heads"], config["mamba_head_dim"], config["ssm_state_size"])
    assert (conv.dtype, ssm.dtype) == (config["torch_dtype"], config["mamba_ssm_cache_dtype"])
    assert (spec.full_attention.num_kv_heads, spec.full_attention.head_dim) == (
        config["num_key_value_heads"],
        config["head_dim"],
    )
    # every layer kind is present, so every cache kind is exercised
    kinds = {type(layer).__name__ for layer in model.layers}
    assert kinds == {"AttentionLayer", "Mamba2Layer", "MlpLayer"}


@pytest.mark.parametrize("path", [REFERENCE_DENSE_CONFIG, REFERENCE_SWA_CONFIG])
def test_non_hybrid_mamba_configs_are_refused_with_the_problem(path) -> None:
    architecture = json.loads(path.read_text())["architectures"][0]
    spec = spec_from_hf(path)
    with pytest.raises(ImplCannotRun) as excinfo:
        ReferenceModel(spec)
    facts = (excinfo.value.impl, excinfo.value.source, excinfo.value.problem)
    assert facts == ("reference", spec.source, NOT_MAMBA2_HYBRID)
    assert excinfo.value.reason == unsupported_reason(spec) and architecture in excinfo.value.reason


def test_oracle_generations_differ_across_prompts(oracle: list[list[int]]) -> None:
    # Parity tests below mean little if the model emits one token whatever the input.
    assert len({tuple(tokens) for tokens in oracle}) == len(oracle)
    assert all(len(set(tokens)) >= 3 for tokens in oracle)
    assert all(len(tokens) == NEW_TOKENS for tokens in oracle)


@pytest.mark.parametrize("page_size", [4, 16])
def test_batched_generation_through_the_pool_matches_the_nocache_oracle(
    model: ReferenceModel, prompts: list[list[int]], oracle: list[list[int]], page_size: int
) -> None:
    pool = make_pool(model, page_size=page_size)
    assert model.generate(pool, prompts, NEW_TOKENS) == oracle
    assert_all_free(pool)


def test_shuffling_pages_and_slots_between_decode_steps_keeps_every_token(
    model: ReferenceModel, prompts: list[list[int]], oracle: list[list[int]]
) -> None:
    pool = make_pool(model, page_size=4)
    generator = torch.Generator().manual_seed(7)
    moved_pages = 0

    def shuffle() -> None:
        nonlocal moved_pages
        before = {rid: pool.page_ids(rid).tolist() for rid in pool.request_ids}
        pool.shuffle(generator)
        pool.check_invariants()
        after = {rid: pool.page_ids(rid).tolist() for rid in pool.request_ids}
        moved_pages += sum(b != a for rid in before for b, a in zip(before[rid], after[rid], strict=True))

    assert model.generate(pool, prompts, NEW_TOKENS, between_steps=shuffle) == oracle
    assert moved_pages > 0
    assert_all_free(pool)


def test_requests_joining_a_running_decode_batch_match_the_oracle(
    model: ReferenceModel, prompts: list[list[int]], oracle: list[list[int]]
) -> None:
    pool = make_pool(model, page_size=4)
    early, late = ["r0", "r1"], ["r2", "r3", "r4"]
    ids = early + late
    generated: dict[str, list[int]] = {}
    for group in (early, late):
        for rid in group:
            pool.reserve(rid, len(prompts[ids.index(rid)]))
        firsts = prefill_tokens(model, pool, {rid: prompts[ids.index(rid)] for rid in group})
        generated.update({rid: [token] for rid, token in zip(group, firsts, strict=True)})
        # the running batch decodes 3 steps before the late group arrives, then all decode together
        steps = 3 if group is early else NEW_TOKENS - 1
        for _ in range(steps):
            running = [rid for rid in ids if rid in generated and len(generated[rid]) < NEW_TOKENS]
            for rid in running:
                pool.extend(rid, 1)
            tokens = model.decode_step(pool, running, [generated[rid][-1] for rid in running])
            for rid, token in zip(running, tokens, strict=True):
                generated[rid].append(token)
    assert [generated[rid] for rid in ids] == oracle
    for rid in ids:
        pool.release(rid)
    assert_all_free(pool)


def test_real_unified_pool_compacting_between_decode_steps_matches_the_oracle(
    model: ReferenceModel, prompts: list[list[int]], oracle: list[list[int]]
) -> None:
    args = PoolArgs(enable_unified_memory=True, page_size=4, context_len=64, max_running_requests=8)
    pool = build_pool(size_pools(model.spec, args, budget_bytes=1 << 20), "cpu")
    fillers = [f"filler-{i}" for i in range(3)]
    for rid in fillers:  # reserved ahead of the batch, released after prefill: holes to close
        pool.reserve(rid, 9)
    bytes_moved: list[int] = []

    def release_fillers_then_compact() -> None:
        if not bytes_moved:
            for rid in fillers:
                pool.release(rid)
        bytes_moved.append(pool.compact())
        pool.check_invariants()

    assert model.generate(pool, prompts, NEW_TOKENS, between_steps=release_fillers_then_compact) == oracle
    assert bytes_moved[0] > 0
    assert pool.request_ids == []
    pool.check_invariants()


def test_prefill_and_decode_write_exactly_the_rows_of_their_tokens(model: ReferenceModel) -> None:
    pool = make_pool(model, page_size=4, num_pages=8, num_slots=3)
    pool.reserve("a", 5)  # pages 0, 1 (row 0 of page 1 used)
    pool.reserve("b", 1)  # page 2 (row 0)
    first = prefill_tokens(model, pool, {"a": [3, 1, 4, 1, 5], "b": [9]})
    written = {(0, r) for r in range(4)} | {(1, 0), (2, 0)}
    for layer in model.spec.full_attention_layers:
        for cache in pool.kv_view(layer):
            finite = {(p, r) for p, r in (~cache.isnan()).all(dim=(2, 3)).nonzero().tolist()}
            assert finite == written
    for layer in model.spec.mamba_layers:
        for state in pool.state_view(layer):
            assert (~state.isnan()).flatten(1).all(dim=1).nonzero().flatten().tolist() == [0, 1]

    pool.extend("a", 1)
    pool.extend("b", 1)
    model.decode_step(pool, ["a", "b"], first)
    written |= {(1, 1), (2, 1)}
    for layer in model.spec.full_attention_layers:
        for cache in pool.kv_view(layer):
            finite = {(p, r) for p, r in (~cache.isnan()).all(dim=(2, 3)).nonzero().tolist()}
            assert finite == written


def test_same_seed_gives_same_weights_and_tokens_other_seed_differs(
    model: ReferenceModel, prompts: list[list[int]], oracle: list[list[int]]
) -> None:
    again = ReferenceModel(spec_from_hf(REFERENCE_HYBRID_CONFIG), seed=0)
    other = ReferenceModel(spec_from_hf(REFERENCE_HYBRID_CONFIG), seed=1)
    assert torch.equal(again.embedding, model.embedding)
    assert torch.equal(again.lm_head, model.lm_head)
    for mine, theirs in zip(model.layers, again.layers, strict=True):
        assert vars(mine).keys() == vars(theirs).keys()
        for name, value in vars(mine).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, vars(theirs)[name]), name
    assert [again.generate_nocache(p, NEW_TOKENS) for p in prompts[:2]] == oracle[:2]

    assert not torch.equal(other.embedding, model.embedding)
    attention = next(layer for layer in other.layers if isinstance(layer, AttentionLayer))
    assert not torch.equal(attention.q_proj, model.layers[model.spec.full_attention_layers[0]].q_proj)
    mamba = next(layer for layer in other.layers if isinstance(layer, Mamba2Layer))
    assert not torch.equal(mamba.in_proj, model.layers[model.spec.mamba_layers[0]].in_proj)
    assert [other.generate_nocache(p, NEW_TOKENS) for p in prompts[:2]] != oracle[:2]


def test_generate_releases_what_it_reserved_when_the_pool_runs_out(
    model: ReferenceModel, prompts: list[list[int]]
) -> None:
    pool = make_pool(model, page_size=16, num_pages=3)  # prompts of 1, 5 and 16 tokens fill it
    with pytest.raises(DoesNotFit):
        model.generate(pool, prompts, NEW_TOKENS)
    assert_all_free(pool)


def test_misuse_is_refused(model: ReferenceModel) -> None:
    pool = make_pool(model, page_size=4)
    pool.reserve("short", 3)
    with pytest.raises(BatchRefused) as refused:
        prefill_tokens(model, pool, {"short": [1, 2, 3, 4]})
    assert (refused.value.problem, refused.value.request_id) == (TOKENS_NOT_RESERVED, "short")
    pool.reserve("one", 1)
    first = prefill_tokens(model, pool, {"one": [7]})
    with pytest.raises(BatchRefused) as refused:
        model.decode_step(pool, ["one"], first)  # not extended: no row for the new token
    assert refused.value.problem == NOT_EXTENDED
    pool.extend("one", 1)
    with pytest.raises(BatchRefused) as refused:
        model.decode_step(pool, ["one", "one"], first * 2)
    assert refused.value.problem == DUPLICATE_REQUEST
    with pytest.raises(TokenIdsOutOfRange) as refused:
        model.decode_step(pool, ["one"], [model.vocab_size])
    facts = (refused.value.what, refused.value.bad, refused.value.vocab_size)
    assert facts == ("last_tokens", model.vocab_size, model.vocab_size)
    with pytest.raises(BatchRefused) as refused:
        model.generate_nocache([], 1)
    assert (refused.value.problem, refused.value.request_id, refused.value.value) == (EMPTY_PROMPT, None, 0)


@pytest.mark.parametrize("page_size", [4, 16])
def test_unified_arena_and_static_pools_generate_the_same_tokens_as_the_oracle(
    model: ReferenceModel, prompts: list[list[int]], oracle: list[list[int]], page_size: int
) -> None:
    outputs = {}
    for unified in (True, False):
        args = PoolArgs(enable_unified_memory=unified, page_size=page_size, context_len=64)
        pool = build_pool(size_pools(model.spec, args, budget_bytes=1 << 20), "cpu")
        assert pool.kind == ("unified" if unified else "static")
        outputs[unified] = model.generate(pool, prompts, NEW_TOKENS, between_steps=pool.check_invariants)
        assert pool.request_ids == []
        assert free_units(pool) == free_units(build_pool(pool.sizes, "cpu"))
    assert outputs[True] == outputs[False] == oracle


def test_support_is_decided_from_the_spec_alone() -> None:
    spec = spec_from_hf(REFERENCE_HYBRID_CONFIG)
    assert unsupported_reason(spec) is None
    # The spec is all a worker gets: the same weights whatever file (if any) it came from.
    moved = ReferenceModel(dataclasses.replace(spec, source="<elsewhere>"), seed=0)
    assert torch.equal(moved.embedding, ReferenceModel(spec, seed=0).embedding)
    real = spec_from_hf(FIXTURES / "nemotron_h.json")  # a real checkpoint's dims: billions of parameters
    for spec, problem in ((real, TOO_LARGE), (spec_from_hf(FIXTURES / "qwen3_next.json"), NOT_MAMBA2_HYBRID)):
        with pytest.raises(ImplCannotRun) as refused:
            check_supported(spec)
        assert (refused.value.problem, refused.value.reason) == (problem, unsupported_reason(spec))
