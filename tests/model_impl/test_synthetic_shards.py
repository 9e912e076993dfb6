"""The synthetic pattern on tensor-parallel shards: a rank's bytes are the unsharded tensor's bytes at
the rank's coordinates, after prefill and after decode steps; at TP 1 the bytes are those of the
pattern before TP existed."""

from __future__ import annotations

import hashlib

import pytest
import torch

from distpool.memory.arena_pool import ArenaPool
from distpool.model.shard import shard
from distpool.model.spec import ModelSpec
from distpool.model_impl.errors import ShardMismatch
from distpool.model_impl.synthetic.model import SyntheticCache
from tests.factories import TP_CONFIGS, make_pool, make_rank_pool, make_spec, prefill_tokens, tp_spec

PROMPT = [7, 1, 2, 9, 4, 4, 8, 3, 0, 5, 6]
STEPS = 3


def serve(spec: ModelSpec, pool: ArenaPool, cache: SyntheticCache) -> list[int]:
    """Prefill PROMPT as request "a" and run STEPS decode steps; the tokens generated."""
    pool.reserve("a", len(PROMPT))
    tokens = prefill_tokens(cache, pool, {"a": PROMPT})
    out = list(tokens)
    for _ in range(STEPS):
        pool.extend("a", 1)
        tokens = cache.decode_step(pool, ["a"], tokens)
        out += tokens
    return out


def envelope_digest(pool: ArenaPool) -> str:
    """The envelope's bytes in the order the arena held them when a slot kept each layer's state
    tensors side by side and a page each K and V as (page_size, kv_heads, dim): the slot layer by
    layer, each tensor padded to 64 bytes with zeros; each page's K and V token by token, then its
    padding. Independent of the order a slot and a page keep them in now."""
    h = hashlib.sha256()
    spec, ranges = pool.sizes.spec, pool.envelope_ranges("a").tolist()
    if spec.mamba is not None:
        ranges.pop(0)
        slot = pool.slot_id("a")
        for layer in spec.mamba_layers:
            for tensor in pool.state_view(layer):
                raw = tensor[slot].contiguous().view(torch.uint8).numpy().tobytes()
                h.update(raw + bytes(-len(raw) % 64))
    pages = [(page, spec.full_attention_layers, pool.kv_view) for page in pool.page_ids("a").tolist()]
    if spec.sliding_window_layers:
        swa = pool.swa_page_ids("a").tolist()
        pages += [(page, spec.sliding_window_layers, pool.swa_kv_view) for page in swa]
    for (page, layers, view), (_, stride) in zip(pages, ranges, strict=True):
        held = 0
        for layer in layers:
            for tensor in view(layer):
                row = tensor[page].contiguous().view(torch.uint8)
                h.update(row.numpy().tobytes())
                held += row.numel()
        h.update(bytes(stride - held))
    return h.hexdigest()[:16]


@pytest.mark.parametrize(
    "spec,digest",
    [
        (make_spec(), "8c60f62c10799d8a"),  # int64 words everywhere
        (make_spec(conv_shape=(3, 5), kv_dtype="float8_e4m3fn", head_dim=3), "befd196903eed615"),  # bytes
    ],
    ids=["words", "bytes"],
)
def test_one_rank_holds_the_bytes_it_held_before_tensor_parallelism(spec, digest):
    """Regression: the digests were taken from the pattern as it was before shards existed."""
    pool = make_pool(spec, budget_bytes=1 << 20, context_len=32)
    serve(spec, pool, SyntheticCache(spec, seed=5))
    assert envelope_digest(pool) == digest


def rows(pool: ArenaPool, spec: ModelSpec) -> dict[tuple[int, str], torch.Tensor]:
    """Every tensor of request "a" as (rows, row bytes) uint8: one row per token slot of its pages
    (full and window) for K and V, one row per state tensor."""
    out = {}
    kv = [(spec.full_attention_layers, pool.kv_view, pool.page_ids("a"), "")]
    kv += [(spec.sliding_window_layers, pool.swa_kv_view, pool.swa_page_ids("a"), "swa_")]
    for layers, view_of, pages, prefix in kv:
        for layer in layers:
            for name, view in zip("kv", view_of(layer), strict=True):
                if view.numel():  # (MLA caches no V)
                    held = view[pages].contiguous().view(torch.uint8)  # (pages, page_size, heads, bytes)
                    out[layer, prefix + name] = held.reshape(-1, held[0, 0].numel())
    for layer in spec.mamba_layers:
        for tensor, view in zip(spec.mamba.tensors, pool.state_view(layer), strict=True):
            out[layer, tensor.name] = view[pool.slot_id("a")].contiguous().view(torch.uint8).reshape(1, -1)
    return out


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", list(TP_CONFIGS))
def test_a_shard_holds_the_unsharded_bytes_at_its_coordinates(model, tp):
    spec = tp_spec(model)
    whole = make_rank_pool(shard(spec, 1, 0), unified=True)
    tokens = serve(spec, whole, SyntheticCache(spec, seed=5))
    expected = rows(whole, spec)
    for rank in range(tp):
        rank_shard = shard(spec, tp, rank)
        pool = make_rank_pool(rank_shard, unified=True)
        assert serve(spec, pool, SyntheticCache(spec, seed=5, shard=rank_shard)) == tokens
        for (layer, name), held in rows(pool, rank_shard.spec).items():
            tensor = rank_shard.tensor(name)
            at = torch.cat([expected[layer, name][:, a:b] for a, b in tensor.byte_pieces()], dim=1)
            assert torch.equal(held, at), (layer, name, rank)


def test_a_pool_that_is_not_the_shards_is_refused_with_the_fix():
    spec = tp_spec("mamba2_groups1")
    rank_shard = shard(spec, 2, 1)
    whole = make_rank_pool(shard(spec, 1, 0), unified=True)
    whole.reserve("a", len(PROMPT))
    with pytest.raises(ShardMismatch) as refused:
        prefill_tokens(SyntheticCache(spec, seed=5, shard=rank_shard), whole, {"a": PROMPT})
    tensor = rank_shard.tensor(refused.value.field)  # the first tensor the prefill wrote
    assert (refused.value.expected, refused.value.got) == (tensor.nbytes, tensor.row_bytes)
    other = tp_spec("mamba2_groups8")
    with pytest.raises(ShardMismatch) as refused:
        SyntheticCache(other, shard=rank_shard)
    assert (refused.value.field, refused.value.expected, refused.value.got) == (
        "model",
        other.source,
        spec.source,
    )
