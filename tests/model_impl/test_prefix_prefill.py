"""Prefill after a cached prefix: both models compute only the suffix, start from the checkpoint's
state, never write the shared pages or the checkpoint, and go on exactly as a prefill of the whole
prompt would: token for token for the reference model, byte for byte for the synthetic cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from distpool.memory.arena_pool import ArenaPool
from distpool.model.hf_config import spec_from_hf
from distpool.model.spec import DENSE, ModelSpec
from distpool.model_impl.errors import (
    CACHED_NOT_AS_RESERVED,
    CACHED_OUT_OF_RANGE,
    DUPLICATE_REQUEST,
    NO_CHECKPOINT,
    NOT_REGISTERED,
    SLOT_OUT_OF_RANGE,
    SLOTS_OVERLAP,
    SNAPSHOT_OUT_OF_RANGE,
    BatchRefused,
)
from distpool.model_impl.pool_model import PoolModel
from distpool.model_impl.prefill_job import PrefillJob
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.model_impl.reference.model import ReferenceModel
from distpool.model_impl.synthetic.model import CorruptCheckpoint, Mismatch, SyntheticCache
from distpool.model_impl.synthetic.pattern import state_rows
from tests.factories import make_sizes, make_spec, prefill_tokens
from tests.model_impl.test_synthetic import NEMOTRON, copy_envelope

PAGE = 4
STEPS = 6  # decode steps after the first token
HYBRID = spec_from_hf(REFERENCE_HYBRID_CONFIG)


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(HYBRID, seed=0)


def prefix_pool(spec: ModelSpec) -> ArenaPool:
    unified = spec.kind != DENSE  # unified memory is for hybrid models only
    sizes = make_sizes(spec, unified=unified, budget_bytes=1 << 20, page_size=PAGE, context_len=64)
    return ArenaPool(sizes, "cpu", prefix_cache=True)


def tokens(n: int, seed: int, vocab_size: int = HYBRID.vocab_size) -> list[int]:
    return torch.randint(vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def shared_bytes(pool: ArenaPool, rid: str, num_pages: int, checkpoint_slot: int | None) -> torch.Tensor:
    """A copy of the bytes of the request's first `num_pages` pages and of a checkpoint slot."""
    first = 0 if pool.slot_id(rid) is None else 1  # envelope rows: the slot (if any), then the pages
    rows = pool.envelope_ranges(rid).tolist()[first : first + num_pages]
    if checkpoint_slot is not None:
        low = pool.arena.low
        rows.append([low.base_bytes + checkpoint_slot * low.stride_bytes, low.stride_bytes])
    return torch.cat([pool.buffer[at : at + nbytes] for at, nbytes in rows]).clone()


def cache_first_request(cache: PoolModel, pool: ArenaPool, prompt: list[int], depth: int) -> tuple[int, int]:
    """Prefill `prompt` as "a" with a snapshot at page `depth`, then cache its pages and that
    checkpoint: (a's first token, the checkpoint's handle)."""
    pool.reserve("a", len(prompt))
    handle, slot = pool.prefix_cache.take_checkpoint()
    (done,) = cache.prefill(pool, [PrefillJob("a", prompt, snapshot=(depth * PAGE, slot))])
    assert (done.request_id, done.computed_tokens) == ("a", len(prompt))
    assert pool.prefix_cache.cache_request("a", prompt, {depth: handle}).checkpoints == (handle,)
    return done.first_token, handle


def decode(
    cache: PoolModel, pool: ArenaPool, ids: list[str], firsts: list[int], steps: int
) -> list[list[int]]:
    """The first tokens and `steps` decode steps of requests `ids`, batched."""
    generated = [[t] for t in firsts]
    for _ in range(steps):
        for rid in ids:
            pool.extend(rid, 1)
        step = cache.decode_step(pool, ids, [out[-1] for out in generated])
        for out, token in zip(generated, step, strict=True):
            out.append(token)
    return generated


@pytest.mark.parametrize(("depth", "shared"), [(4, 17), (2, 13)])
def test_reference_prefills_only_the_suffix_and_generates_the_tokens_of_a_full_prefill(
    model: ReferenceModel, depth: int, shared: int
) -> None:
    pool, a, c = prefix_pool(HYBRID), tokens(18, 1), tokens(10, 3)
    b = a[:shared] + tokens(21 - shared, 2)  # b shares a's first `shared` tokens, not all its pages
    cache = pool.prefix_cache
    first_a, handle = cache_first_request(model, pool, a, depth)
    checkpoint = cache.checkpoint_slot(handle)
    # the snapshot holds exactly the state a prefill of a's first `depth` pages leaves
    pool.reserve("head", depth * PAGE)
    model.prefill(pool, [PrefillJob("head", a[: depth * PAGE])])
    for layer in HYBRID.mamba_layers:
        for view in pool.state_view(layer):
            assert torch.equal(view[checkpoint], view[pool.slot_id("head")])
    pool.release("head")

    match = cache.match(b)
    assert (match.num_tokens, match.checkpoint) == (depth * PAGE, handle)
    pool.reserve("b", len(b), prefix=match)
    pool.reserve("c", len(c))  # no cached prefix, in the same batch
    assert pool.page_ids("b")[:depth].tolist() == pool.page_ids("a")[:depth].tolist()
    before = shared_bytes(pool, "b", depth, checkpoint)
    jobs = [PrefillJob("b", b, cached=match.num_tokens, checkpoint_slot=checkpoint), PrefillJob("c", c)]
    done = model.prefill(pool, jobs)
    assert [d.computed_tokens for d in done] == [len(b) - depth * PAGE, len(c)]
    assert torch.equal(shared_bytes(pool, "b", depth, checkpoint), before)  # shared: read only

    generated = decode(model, pool, ["a", "b", "c"], [first_a, *(d.first_token for d in done)], STEPS)
    assert generated == [model.generate_nocache(p, STEPS + 1) for p in (a, b, c)]
    pool.check_invariants()


def test_a_snapshot_at_the_last_token_is_the_final_state(model: ReferenceModel) -> None:
    pool, a = prefix_pool(HYBRID), tokens(12, 4)
    first, handle = cache_first_request(model, pool, a, depth=3)
    checkpoint = pool.prefix_cache.checkpoint_slot(handle)
    for layer in HYBRID.mamba_layers:
        for view in pool.state_view(layer):
            assert torch.equal(view[checkpoint], view[pool.slot_id("a")])
    assert decode(model, pool, ["a"], [first], STEPS) == [model.generate_nocache(a, STEPS + 1)]


@pytest.mark.parametrize("spec", [make_spec(), NEMOTRON], ids=["small", "nemotron_h"])
def test_synthetic_suffix_prefill_verifies_at_check_and_after_a_transfer(spec: ModelSpec) -> None:
    vocab = spec.vocab_size or 32000
    pool, a = prefix_pool(spec), tokens(14, 5, vocab)
    b = a[:9] + tokens(6, 6, vocab)
    synthetic = SyntheticCache(spec)
    cache_first_request(synthetic, pool, a, depth=2)
    match = pool.prefix_cache.match(b)
    assert match.num_tokens == 2 * PAGE
    pool.reserve("b", len(b), prefix=match)
    checkpoint = pool.prefix_cache.checkpoint_slot(match.checkpoint)
    before = shared_bytes(pool, "b", 2, checkpoint)
    (done,) = synthetic.prefill(
        pool, [PrefillJob("b", b, cached=match.num_tokens, checkpoint_slot=checkpoint)]
    )
    assert done.computed_tokens == len(b) - 2 * PAGE
    first = done.first_token
    assert torch.equal(shared_bytes(pool, "b", 2, checkpoint), before)
    assert synthetic.check(pool, "b") is None

    uncached = SyntheticCache(spec).generate(prefix_pool(spec), [b], STEPS + 1)[0]
    destination = prefix_pool(spec)
    destination.reserve("b", len(b))
    copy_envelope(pool, destination, "b")
    decoder = SyntheticCache(spec)
    assert decoder.admit(destination, "b", b, first) is None
    assert decode(decoder, destination, ["b"], [first], STEPS) == [uncached]
    assert decode(synthetic, pool, ["b"], [first], STEPS) == [uncached]
    assert decoder.check(destination, "b") is None and synthetic.check(pool, "b") is None


def test_synthetic_refuses_a_corrupt_checkpoint_and_writes_nothing() -> None:
    pool, a = prefix_pool(NEMOTRON), tokens(14, 7, NEMOTRON.vocab_size)
    synthetic = SyntheticCache(NEMOTRON)
    cache_first_request(synthetic, pool, a, depth=3)
    match = pool.prefix_cache.match(a[:12] + [1, 2])
    pool.reserve("b", 14, prefix=match)
    checkpoint = pool.prefix_cache.checkpoint_slot(match.checkpoint)
    layer = NEMOTRON.mamba_layers[1]
    rows = state_rows(pool.state_view(layer)[1])[checkpoint]  # (rows, row bytes)
    rows[divmod(20, rows.shape[1])] ^= 0xFF  # the tensor's byte 20 in row-major order
    before = pool.buffer.clone()
    with pytest.raises(CorruptCheckpoint) as failure:
        synthetic.prefill(pool, [PrefillJob("b", a[:12] + [1, 2], cached=12, checkpoint_slot=checkpoint)])
    assert (failure.value.request_id, failure.value.slot, failure.value.num_tokens) == ("b", checkpoint, 12)
    wrong = Mismatch(kind="state", layer=layer, tensor="ssm", position=None, byte_offset=20)
    assert failure.value.mismatch == wrong and str(wrong) in str(failure.value)
    assert torch.equal(pool.buffer, before)
    with pytest.raises(BatchRefused) as unknown:
        synthetic.check(pool, "b")
    assert (unknown.value.problem, unknown.value.request_id) == (NOT_REGISTERED, "b")


def test_synthetic_dense_model_needs_no_checkpoint_and_ignores_snapshots() -> None:
    spec = make_spec(DENSE)
    vocab = 32000
    pool, a = prefix_pool(spec), tokens(14, 8, vocab)
    b = a[:12] + tokens(3, 9, vocab)
    synthetic = SyntheticCache(spec)
    pool.reserve("a", len(a))
    synthetic.prefill(pool, [PrefillJob("a", a, snapshot=(2 * PAGE, 0))])  # no state: nothing to snapshot
    pool.prefix_cache.cache_request("a", a)
    match = pool.prefix_cache.match(b)
    assert (match.num_tokens, match.checkpoint) == (12, None)
    pool.reserve("b", len(b), prefix=match)
    before = shared_bytes(pool, "b", 3, None)
    (done,) = synthetic.prefill(pool, [PrefillJob("b", b, cached=12)])
    assert done.computed_tokens == 3
    first = done.first_token
    assert torch.equal(shared_bytes(pool, "b", 3, None), before)
    uncached = SyntheticCache(spec).generate(prefix_pool(spec), [b], STEPS + 1)[0]
    assert decode(synthetic, pool, ["b"], [first], STEPS) == [uncached]
    assert synthetic.check(pool, "b") is None


@pytest.mark.parametrize("kind", ["reference", "synthetic"])
def test_misuse_is_refused_with_its_facts_before_anything_is_written(
    model: ReferenceModel, kind: str
) -> None:
    cache: PoolModel = model if kind == "reference" else SyntheticCache(HYBRID)
    pool, a = prefix_pool(HYBRID), tokens(14, 10)
    cache_first_request(cache, pool, a, depth=2)
    b = a[:9] + [1, 2, 3]
    match = pool.prefix_cache.match(b)
    pool.reserve("b", len(b), prefix=match)
    pool.reserve("c", 8)
    checkpoint = pool.prefix_cache.checkpoint_slot(match.checkpoint)
    spare, spare_slot = pool.prefix_cache.take_checkpoint()
    num_slots = pool.state_view(HYBRID.mamba_layers[0])[0].shape[0]
    before = pool.buffer.clone()
    c = tokens(8, 11)
    usable = PrefillJob("b", b, cached=8, checkpoint_slot=checkpoint)  # b's cached prefix, as reserved
    refusals = [
        ([replace(usable, cached=6)], CACHED_OUT_OF_RANGE, "b", 6, (PAGE, 12)),
        ([PrefillJob("c", c, cached=8, checkpoint_slot=checkpoint)], CACHED_OUT_OF_RANGE, "c", 8, (PAGE, 8)),
        ([PrefillJob("b", b)], CACHED_NOT_AS_RESERVED, "b", 0, 8),  # would overwrite shared cached pages
        (
            [PrefillJob("c", c, cached=4, checkpoint_slot=checkpoint)],
            CACHED_NOT_AS_RESERVED,
            "c",
            4,
            0,
        ),  # unwritten
        ([replace(usable, checkpoint_slot=None)], NO_CHECKPOINT, "b", 8, None),
        ([replace(usable, checkpoint_slot=num_slots)], SLOT_OUT_OF_RANGE, "b", num_slots, num_slots),
        ([replace(usable, snapshot=(2 * PAGE, spare_slot))], SNAPSHOT_OUT_OF_RANGE, "b", 2 * PAGE, (8, 12)),
        (
            [replace(usable, snapshot=(3 * PAGE - 1, spare_slot))],
            SNAPSHOT_OUT_OF_RANGE,
            "b",
            3 * PAGE - 1,
            (8, 12),
        ),
        ([replace(usable, snapshot=(3 * PAGE, checkpoint))], SLOTS_OVERLAP, None, None, None),
        ([usable, usable], DUPLICATE_REQUEST, None, ["b", "b"], None),
    ]
    for jobs, problem, request_id, value, limit in refusals:
        with pytest.raises(BatchRefused) as refused:
            cache.prefill(pool, jobs)
        assert (refused.value.problem, refused.value.request_id) == (problem, request_id)
        if value is not None:
            assert (refused.value.value, refused.value.limit) == (value, limit)
    assert torch.equal(pool.buffer, before)
    # and used as meant, with a snapshot at b's last full page into the spare unit
    (done,) = cache.prefill(pool, [replace(usable, snapshot=(3 * PAGE, spare_slot))])
    assert done.computed_tokens == 4
    adopted = pool.prefix_cache.cache_request("b", b, {3: spare})
    assert adopted.checkpoints == (spare,) and len(adopted.pages) == 1  # b's third page is new content


@pytest.mark.parametrize("kind", ["reference", "synthetic"])
def test_prefill_never_writes_a_shared_page(model: ReferenceModel, kind: str) -> None:
    """A byte marked in the shared prefix survives the prefill of a request that shares it (rewriting
    a shared row with equal bytes would go unnoticed otherwise)."""
    cache: PoolModel = model if kind == "reference" else SyntheticCache(HYBRID)
    pool, a = prefix_pool(HYBRID), tokens(13, 12)
    cache_first_request(cache, pool, a, depth=3)
    b = a[:12] + [5, 6]
    match = pool.prefix_cache.match(b)
    pool.reserve("b", len(b), prefix=match)
    layer = HYBRID.full_attention_layers[-1]
    k, _ = pool.kv_view(layer)
    row = k[pool.page_ids("b")[2], PAGE - 1].view(torch.uint8)  # token 11, the prefix's last: (heads, bytes)
    row[0, 0] ^= 1
    marked = row.clone()
    checkpoint = pool.prefix_cache.checkpoint_slot(match.checkpoint)
    cache.prefill(pool, [PrefillJob("b", b, cached=12, checkpoint_slot=checkpoint)])
    assert torch.equal(row, marked)
    if kind == "synthetic":  # and verification finds exactly that byte
        assert cache.check(pool, "b") == Mismatch(
            kind="kv", layer=layer, tensor="k", position=11, byte_offset=0
        )


def test_a_request_continues_in_place_from_its_own_slot_with_only_its_new_tokens(
    model: ReferenceModel,
) -> None:
    """A new turn of a sequence a worker holds (conditional disaggregation's decode-side prefill): the
    job's checkpoint is the request's own slot, its cached tokens end off a page boundary, and only
    the new tokens are computed."""
    pool, turn, more = prefix_pool(HYBRID), tokens(10, 13), tokens(5, 14)
    pool.reserve("a", len(turn))
    prefill_tokens(model, pool, {"a": turn})
    pool.extend("a", len(more))
    job = PrefillJob("a", turn + more, cached=len(turn), checkpoint_slot=pool.slot_id("a"))
    with pytest.raises(BatchRefused) as refused:  # another slot: only whole cached pages
        model.prefill(pool, [replace(job, checkpoint_slot=pool.prefix_cache.take_checkpoint()[1])])
    assert refused.value.problem == CACHED_OUT_OF_RANGE
    (done,) = model.prefill(pool, [job])
    assert done.computed_tokens == len(more)
    oracle = model.generate_nocache(turn + more, STEPS + 1)
    assert decode(model, pool, ["a"], [done.first_token], STEPS) == [oracle]
