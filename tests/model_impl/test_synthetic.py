"""The synthetic cache: deterministic tokens, envelopes that survive a transfer byte for byte, and
every kind of damage reported as the first wrong byte, with nothing registered and nothing moved."""

from __future__ import annotations

import pickle
from dataclasses import replace
from itertools import accumulate

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from distpool.memory.arena_pool import ArenaPool
from distpool.memory.pool import DoesNotFit
from distpool.model.hf_config import spec_from_hf
from distpool.model.spec import AttentionSpec, ModelSpec
from distpool.model_impl.errors import (
    ALREADY_REGISTERED,
    DUPLICATE_REQUEST,
    NOT_EXTENDED,
    NOT_REGISTERED,
    TOKENS_NOT_RESERVED,
    WRONG_TOKEN,
    BatchRefused,
    ImplCannotRun,
    TokenIdsOutOfRange,
)
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.model_impl.reference.model import ReferenceModel
from distpool.model_impl.select import MODEL_IMPLS, build_model_impl, choose_model_impl
from distpool.model_impl.synthetic.model import Mismatch, SyntheticCache
from distpool.model_impl.synthetic.pattern import (
    next_hash,
    prefix_hashes,
    read_state,
    state_rows,
    write_state_bytes,
)
from tests.factories import FIXTURES, accounting, make_pool, make_spec, prefill_tokens

PAGE = 4
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # 11 tokens: three pages, the last one partly filled
STEPS = 12


def shrink(name: str, num_layers: int) -> ModelSpec:
    """A fixture's layer kinds and dtypes, cut to its first `num_layers` layers and tiny widths."""
    spec = spec_from_hf(FIXTURES / f"{name}.json")
    kinds = ("full_attention_layers", "sliding_window_layers", "mamba_layers")
    layers = {kind: tuple(i for i in getattr(spec, kind) if i < num_layers) for kind in kinds}

    def narrow(attention: AttentionSpec | None) -> AttentionSpec | None:
        window = attention and attention.sliding_window and 2 * PAGE
        return attention and replace(
            attention, num_kv_heads=2, head_dim=8, v_head_dim=8, sliding_window=window
        )

    tensors = spec.mamba and tuple(
        replace(t, shape=tuple(min(d, 6) for d in t.shape)) for t in spec.mamba.tensors
    )
    return replace(
        spec,
        num_layers=num_layers,
        **layers,
        full_attention=narrow(spec.full_attention),
        sliding_attention=narrow(spec.sliding_attention),
        mamba=spec.mamba and replace(spec.mamba, tensors=tensors),
    )


def tiny_mla() -> ModelSpec:
    """One cached latent per token (no V), 18 bytes a row: not whole int64 words."""
    spec = make_spec(conv_shape=(3, 5))  # conv state of 30 bytes: bytes, not words, too
    return replace(
        spec, full_attention=replace(spec.full_attention, num_kv_heads=1, head_dim=9, v_head_dim=0)
    )


SPECS = {  # name: (spec, unified pool)
    "nemotron_h": (shrink("nemotron_h", 16), True),
    "nemotron_h_static": (shrink("nemotron_h", 16), False),
    "qwen3_next": (shrink("qwen3_next", 4), True),
    "falcon_h1": (shrink("falcon_h1", 2), True),  # every layer holds KV and state
    "jamba": (shrink("jamba", 6), False),  # mamba1
    "gemma3": (shrink("gemma3", 7), False),  # sliding window, no state
    "llama3": (shrink("llama3", 2), False),  # dense, no slot
    "fp8_kv": (make_spec(kv_dtype="float8_e4m3fn"), True),
    "mla": (tiny_mla(), True),
}
NEMOTRON = SPECS["nemotron_h"][0]


def pool_for(spec: ModelSpec, unified: bool = True) -> ArenaPool:
    return make_pool(spec, unified=unified, budget_bytes=1 << 20, page_size=PAGE, context_len=64)


def copy_envelope(src: ArenaPool, dst: ArenaPool, request_id: str) -> None:
    """What a transfer does: the envelope's rows, paired in canonical order."""
    src_rows, dst_rows = src.envelope_ranges(request_id).tolist(), dst.envelope_ranges(request_id).tolist()
    assert [n for _, n in src_rows] == [n for _, n in dst_rows]
    for (src_at, nbytes), (dst_at, _) in zip(src_rows, dst_rows, strict=True):
        dst.buffer[dst_at : dst_at + nbytes].copy_(src.buffer[src_at : src_at + nbytes])


def landed(spec: ModelSpec, unified: bool = True) -> tuple[ArenaPool, ArenaPool, int]:
    """Prefill PROMPT as "r" in one pool, transfer it into another whose earlier requests put it
    elsewhere: (source, destination, first token); nothing admitted yet."""
    src, dst = pool_for(spec, unified), pool_for(spec, unified)
    src.reserve("r", len(PROMPT))
    (first,) = prefill_tokens(SyntheticCache(spec), src, {"r": PROMPT})
    dst.reserve_batch([("filler-0", 9), ("filler-1", 9)])
    dst.reserve("r", len(PROMPT))
    assert dst.page_ids("r").tolist() != src.page_ids("r").tolist()
    copy_envelope(src, dst, "r")
    return src, dst, first


def decode(cache: SyntheticCache, pool: ArenaPool, request_id: str, token: int, steps: int) -> list[int]:
    tokens = [token]
    for _ in range(steps):
        pool.extend(request_id, 1)
        tokens += cache.decode_step(pool, [request_id], tokens[-1:])
    return tokens


def test_vectorised_prefix_hashes_follow_the_one_token_step() -> None:
    tokens = torch.randint(1 << 20, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    expected = list(accumulate(tokens, next_hash, initial=0))
    assert prefix_hashes(tokens).tolist() == expected
    assert len(set(expected)) == len(expected)


def test_tokens_are_the_same_every_run_and_batching_and_depend_on_the_prompt() -> None:
    cache, pool = SyntheticCache(NEMOTRON), pool_for(NEMOTRON)
    prompts = [PROMPT, [7] * 5, [7] * 4 + [8]]
    together = cache.generate(pool, prompts, STEPS)
    assert cache.generate(pool, prompts, STEPS) == together
    assert [cache.generate(pool, [p], STEPS)[0] for p in reversed(prompts)] == together[::-1]
    assert SyntheticCache(NEMOTRON).generate(pool_for(NEMOTRON, False), prompts, STEPS) == together
    assert len({tuple(tokens) for tokens in together}) == 3
    assert all(0 <= t < NEMOTRON.vocab_size for tokens in together for t in tokens)
    assert SyntheticCache(NEMOTRON, seed=1).generate(pool, prompts, STEPS) != together
    assert pool.request_ids == []


@pytest.mark.parametrize("name", SPECS)
def test_a_transferred_envelope_is_admitted_decoded_like_colocated_and_checked(name: str) -> None:
    spec, unified = SPECS[name]
    colocated = SyntheticCache(spec).generate(pool_for(spec, unified), [PROMPT], STEPS + 1)[0]
    _, dst, first = landed(spec, unified)
    decoder = SyntheticCache(spec)
    assert decoder.admit(dst, "r", PROMPT, first) is None
    assert decode(decoder, dst, "r", first, STEPS) == colocated
    assert decoder.check(dst, "r") is None
    if unified:
        dst.release_batch(["filler-0", "filler-1"])
        before = dst.page_ids("r").tolist()
        assert dst.compact() > 0 and dst.page_ids("r").tolist() != before
        assert decoder.check(dst, "r") is None
    # the last envelope row is the newest (window) page; its first byte is layer 0's K of its first token
    offset, _ = dst.envelope_ranges("r")[-1].tolist()
    dst.buffer[offset] ^= 0xFF
    swa = bool(spec.sliding_window_layers)
    layer = (spec.sliding_window_layers if swa else spec.full_attention_layers)[0]
    position = (dst.pages_for(len(PROMPT) + STEPS) - 1) * PAGE  # the window ends where the pages do
    kind = "swa_kv" if swa else "kv"
    assert decoder.check(dst, "r") == Mismatch(
        kind=kind, layer=layer, tensor="k", position=position, byte_offset=0
    )


def refused(decoder: SyntheticCache, dst: ArenaPool, prompt: list[int], first: int) -> Mismatch:
    """Admit that must fail: returns the mismatch after checking nothing was registered or moved."""
    before = accounting(dst)
    mismatch = decoder.admit(dst, "r", prompt, first)
    assert isinstance(mismatch, Mismatch)
    assert accounting(dst) == before
    with pytest.raises(BatchRefused) as unknown:
        decoder.check(dst, "r")
    assert (unknown.value.problem, unknown.value.request_id) == (NOT_REGISTERED, "r")
    return mismatch


def test_one_wrong_byte_in_a_kv_row_or_the_state_is_named_exactly() -> None:
    _, dst, first = landed(NEMOTRON)
    layer = NEMOTRON.full_attention_layers[0]
    _, v = dst.kv_view(layer)
    v[dst.page_ids("r")[1], 1].view(torch.uint8)[0, 7] ^= 0xFF  # token 5 = page 1, row 1; head 0
    mismatch = refused(SyntheticCache(NEMOTRON), dst, PROMPT, first)
    assert mismatch == Mismatch(kind="kv", layer=layer, tensor="v", position=5, byte_offset=7)
    v[dst.page_ids("r")[1], 1].view(torch.uint8)[0, 7] ^= 0xFF
    layer = NEMOTRON.mamba_layers[3]
    rows = state_rows(dst.state_view(layer)[1])[dst.slot_id("r")]  # (rows, row bytes)
    rows[divmod(100, rows.shape[1])] ^= 0xFF  # the tensor's byte 100 in row-major order
    mismatch = refused(SyntheticCache(NEMOTRON), dst, PROMPT, first)
    assert mismatch == Mismatch(kind="state", layer=layer, tensor="ssm", position=None, byte_offset=100)
    assert str(mismatch) == f"layer {layer} ssm state, byte 100"


def test_swapped_pages_and_a_zero_last_page_are_found_at_their_first_token() -> None:
    _, dst, first = landed(NEMOTRON)
    rows = dst.envelope_ranges("r").tolist()[1:]  # after the slot: the pages in token order
    (a, nbytes), (b, _) = rows[0], rows[1]
    page_a, page_b = dst.buffer[a : a + nbytes].clone(), dst.buffer[b : b + nbytes].clone()
    dst.buffer[a : a + nbytes], dst.buffer[b : b + nbytes] = page_b, page_a
    mismatch = refused(SyntheticCache(NEMOTRON), dst, PROMPT, first)
    assert (mismatch.kind, mismatch.layer, mismatch.position) == ("kv", NEMOTRON.full_attention_layers[0], 0)
    dst.buffer[a : a + nbytes], dst.buffer[b : b + nbytes] = page_a, page_b
    last, nbytes = rows[-1]
    dst.buffer[last : last + nbytes] = 0  # a transfer cut short
    mismatch = refused(SyntheticCache(NEMOTRON), dst, PROMPT, first)
    assert (mismatch.kind, mismatch.tensor, mismatch.position) == ("kv", "k", 2 * PAGE)
    assert str(mismatch) == f"layer {mismatch.layer} k at token 8, byte {mismatch.byte_offset}"


def test_a_stale_slot_is_found() -> None:
    src, dst, first = landed(NEMOTRON)
    src.reserve("other", len(PROMPT))
    prefill_tokens(SyntheticCache(NEMOTRON), src, {"other": PROMPT[:-1] + [0]})
    other, nbytes = src.envelope_ranges("other")[0].tolist()
    slot, _ = dst.envelope_ranges("r")[0].tolist()
    good = dst.buffer[slot : slot + nbytes].clone()
    dst.buffer[slot : slot + nbytes] = src.buffer[other : other + nbytes]  # another prompt's state
    mismatch = refused(SyntheticCache(NEMOTRON), dst, PROMPT, first)
    assert (mismatch.kind, mismatch.layer) == ("state", NEMOTRON.mamba_layers[0])
    dst.buffer[slot : slot + nbytes] = good
    decoder = SyntheticCache(NEMOTRON)
    assert decoder.admit(dst, "r", PROMPT, first) is None
    tokens = decode(decoder, dst, "r", first, 3)
    before_step = dst.buffer[slot : slot + nbytes].clone()
    decode(decoder, dst, "r", tokens[-1], 1)
    assert decoder.check(dst, "r") is None
    dst.buffer[slot : slot + nbytes] = before_step  # the last step's state write was lost
    assert decoder.check(dst, "r").kind == "state"


@pytest.mark.parametrize("name", ["nemotron_h", "llama3"])
def test_a_prompt_that_differs_in_its_last_token_is_refused(name: str) -> None:
    spec, unified = SPECS[name]
    _, dst, first = landed(spec, unified)
    mismatch = refused(SyntheticCache(spec), dst, PROMPT[:-1] + [PROMPT[-1] + 1], first)
    if spec.mamba_layers:  # the state comes first: it hashes the whole prompt
        assert (mismatch.kind, mismatch.layer) == ("state", spec.mamba_layers[0])
    else:
        assert (mismatch.kind, mismatch.position) == ("kv", len(PROMPT) - 1)


def test_a_shared_prefix_holds_the_same_kv_bytes() -> None:
    cache, pool = SyntheticCache(NEMOTRON), pool_for(NEMOTRON)
    prompts = {"a": PROMPT[:9] + [1, 2], "b": PROMPT[:9] + [7], "c": [8] + PROMPT[1:9]}
    pool.reserve_batch([(rid, len(p)) for rid, p in prompts.items()])
    prefill_tokens(cache, pool, prompts)

    def rows(rid: str, layer: int) -> torch.Tensor:  # (9, 2 * kv_heads * head_dim) of the first 9 tokens
        positions = torch.arange(9)
        k, v = pool.kv_view(layer)
        at = (pool.page_ids(rid)[positions // PAGE], positions % PAGE)
        return torch.cat([k[at].flatten(1), v[at].flatten(1)], dim=1).view(torch.uint8)

    for layer in NEMOTRON.full_attention_layers:
        assert torch.equal(rows("a", layer), rows("b", layer))
        assert (rows("a", layer) != rows("c", layer)).any(dim=1).all()  # every row: the prefix differs


def test_misuse_is_refused_with_its_facts() -> None:
    cache, pool = SyntheticCache(NEMOTRON), pool_for(NEMOTRON)
    pool.reserve("short", 3)
    misuse = [
        (lambda: prefill_tokens(cache, pool, {"short": [1, 2, 3, 4]}), TOKENS_NOT_RESERVED, 3, 4),
        (lambda: cache.decode_step(pool, ["short"], [1]), NOT_REGISTERED, None, None),
    ]
    for call, problem, value, limit in misuse:
        with pytest.raises(BatchRefused) as refused:
            call()
        facts = (refused.value.problem, refused.value.request_id, refused.value.value, refused.value.limit)
        assert facts == (problem, "short", value, limit)
        copy = pickle.loads(pickle.dumps(refused.value))  # crosses Ray's process boundary as itself
        assert (type(copy), vars(copy), str(copy)) == (BatchRefused, vars(refused.value), str(refused.value))
    (first,) = prefill_tokens(cache, pool, {"short": [1, 2, 3]})
    with pytest.raises(BatchRefused) as refused:
        cache.decode_step(pool, ["short"], [first])
    assert (refused.value.problem, refused.value.value, refused.value.limit) == (NOT_EXTENDED, 3, 4)
    pool.extend("short", 1)
    with pytest.raises(BatchRefused) as refused:
        cache.decode_step(pool, ["short", "short"], [first, first])
    assert (refused.value.problem, refused.value.value) == (DUPLICATE_REQUEST, ["short", "short"])
    with pytest.raises(TokenIdsOutOfRange) as refused:
        cache.decode_step(pool, ["short"], [NEMOTRON.vocab_size])
    assert (refused.value.what, refused.value.tokens) == ("last_tokens", (NEMOTRON.vocab_size,))
    with pytest.raises(BatchRefused) as refused:
        cache.decode_step(pool, ["short"], [(first + 1) % NEMOTRON.vocab_size])
    facts = (refused.value.problem, refused.value.value, refused.value.limit)
    assert facts == (WRONG_TOKEN, (first + 1) % NEMOTRON.vocab_size, first)
    with pytest.raises(BatchRefused) as refused:
        cache.admit(pool, "short", [1, 2, 3], first)
    assert refused.value.problem == ALREADY_REGISTERED
    assert cache.decode_step(pool, [], []) == []
    cache.forget("short")
    cache.forget("short")  # absent: nothing to do


def test_generate_releases_and_forgets_when_a_step_fails() -> None:
    cache, pool = SyntheticCache(NEMOTRON), pool_for(NEMOTRON)

    def fail() -> None:
        raise DoesNotFit("synthetic-0", "a step that fails")

    with pytest.raises(DoesNotFit):
        cache.generate(pool, [PROMPT], STEPS, between_steps=fail)
    assert pool.request_ids == []
    pool.reserve("synthetic-0", len(PROMPT))
    with pytest.raises(BatchRefused) as unknown:
        cache.check(pool, "synthetic-0")
    assert (unknown.value.problem, unknown.value.request_id) == (NOT_REGISTERED, "synthetic-0")


def test_the_model_impl_is_chosen_from_the_spec_and_the_name() -> None:
    hybrid, dense = spec_from_hf(REFERENCE_HYBRID_CONFIG), spec_from_hf(FIXTURES / "llama3.json")
    auto = (choose_model_impl(hybrid, "auto"), choose_model_impl(dense, "auto"))
    assert auto == ("reference", "synthetic")
    assert choose_model_impl(hybrid, "synthetic") == choose_model_impl(dense, "synthetic") == "synthetic"
    with pytest.raises(ImplCannotRun) as refused:
        choose_model_impl(dense, "reference")
    assert (refused.value.impl, refused.value.source) == ("reference", dense.source)
    with pytest.raises(ValueError, match=", ".join(MODEL_IMPLS)):
        choose_model_impl(hybrid, "real")
    reference = build_model_impl(hybrid, model_impl="auto", seed=0, device="cpu")
    synthetic = build_model_impl(dense, model_impl="auto", seed=3, device="cpu")
    assert (type(reference), reference.name, reference.verifies) == (ReferenceModel, "reference", False)
    assert (type(synthetic), synthetic.name, synthetic.verifies) == (SyntheticCache, "synthetic", True)
    assert synthetic.seed == 3 and synthetic.vocab_size == dense.vocab_size
    pool = pool_for(hybrid)
    pool.reserve("x", 2)
    (first,) = prefill_tokens(reference, pool, {"x": [1, 2]})
    assert reference.admit(pool, "x", [1, 2], first) is None and reference.check(pool, "x") is None


@settings(max_examples=200, deadline=None)
@given(
    num_rows=st.integers(1, 6),
    width=st.integers(1, 12),
    span=st.tuples(st.integers(0, 72), st.integers(0, 72)),
    word=st.sampled_from([torch.uint8, torch.int16, torch.int64]),
)
def test_a_slots_tensor_is_written_and_read_row_wise_as_the_flat_bytes_would_be(num_rows, width, span, word):
    """A slot interleaves a state tensor's rows with the other layers' (`SLOT_ORDER`): the pattern
    writes a byte range of one slot's tensor over the part of a first row, whole rows and the part
    of a last row, and reads it back in row-major order, as if the tensor were flat."""
    start, stop = (min(end, num_rows * width) for end in sorted(span))
    assume(start < stop)
    layers = 3  # rows of three layers interleave: row r of layer 1 lies between layer 0's and 2's
    arena = torch.zeros(2 * num_rows * layers * width, dtype=torch.uint8)
    view = arena.as_strided((2, num_rows, width), (num_rows * layers * width, layers * width, 1), width)
    rows = state_rows(view)
    data = torch.arange(start + 1, stop + 1, dtype=torch.uint8)  # no byte zero: a stray write shows
    write_state_bytes(rows, 1, start, data.view(word) if data.numel() % word.itemsize == 0 else data)
    flat = torch.zeros(num_rows * width, dtype=torch.uint8)
    flat[start:stop] = data
    assert torch.equal(read_state(rows, 1, torch.uint8), flat)
    assert int(view[0].count_nonzero()) == 0  # slot 0 untouched
    others = arena.clone()
    others.as_strided((2, num_rows, width), (num_rows * layers * width, layers * width, 1), width).zero_()
    assert int(others.count_nonzero()) == 0  # the other layers' rows untouched
