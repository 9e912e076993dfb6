"""Shard rules from real configs: each rank's pieces and bytes at TP 1, 2, 4, 8, what is replicated,
and one-line refusals naming the units and their counts for TP sizes that cannot shard."""

from __future__ import annotations

import hashlib
import json

import pytest

from distpool.memory.sizing import (
    KV_ORDER,
    SLOT_ORDER,
    PoolArgs,
    layout_description,
    layout_fingerprint,
    size_pools,
)
from distpool.model.hf_config import spec_from_hf
from distpool.model.presets import PRESETS_DIR
from distpool.model.shard import (
    ShardArgInvalid,
    TpUnshardable,
    check_tp,
    replicated_parts,
    shard,
    valid_tp_sizes,
)
from tests.factories import TP_CONFIGS, make_spec, tp_spec


def preset(name: str):
    return spec_from_hf(PRESETS_DIR / f"{name}.json")


def test_tp_one_is_the_model_itself_with_the_fingerprint_it_always_had():
    """Regression: the fingerprints were taken before shard rules existed. Since, the description
    gained two fields, the order of K's and V's dims in a page (`kv_order`, heads outermost) and of
    a slot's (`slot_order`, each tensor's rows outermost across layers), which a pool of the former
    orders lacks: the two refuse to pair."""
    spec = preset("nemotron-h-8b")
    whole = shard(spec, 1, 0)
    assert whole.spec is spec and whole.replicated == ()
    assert all(t.pieces == ((0, t.shape[t.axis]),) for t in whole.tensors)
    args = PoolArgs(enable_unified_memory=True, disaggregation_mode="decode")
    for sizes, before in (
        (size_pools(whole.spec, args, 8 << 30), "6d2c3c1e26084734"),
        (size_pools(preset("falcon-h1-7b"), args, 8 << 30), "8a9af2e1645a0b7a"),
    ):
        description = layout_description(sizes)
        assert description.pop("kv_order") == list(KV_ORDER) == ["kv_heads", "page_size", "dim"]
        assert description.pop("slot_order") == list(SLOT_ORDER) == ["tensor", "rows", "layer", "rest"]
        assert hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16] == before
        assert layout_fingerprint(sizes) != before


def test_a_mamba2_conv_state_shards_segment_by_segment():
    """Nemotron-H-8B: conv (10240, 3) = x (128 heads x 64) | B (8 groups x 128) | C (8 x 128)."""
    spec = preset("nemotron-h-8b")
    rank = shard(spec, 2, 1)
    assert rank.tensor("conv").pieces == ((4096, 8192), (8704, 9216), (9728, 10240))
    assert rank.tensor("ssm").pieces == ((64, 128),)
    assert rank.tensor("k").pieces == ((4, 8),)
    mamba = rank.spec.mamba.tensors
    assert [(t.name, t.shape) for t in mamba] == [("conv", (5120, 3)), ("ssm", (64, 64, 128))]
    assert rank.spec.full_attention.num_kv_heads == 4
    assert rank.slot_bytes == 24 * (5120 * 3 * 2 + 64 * 64 * 128 * 4)
    assert rank.kv_bytes_per_token == 4 * 2 * 4 * 128 * 2
    assert rank.replicated == ()


def test_one_group_is_replicated_on_every_rank_beside_its_split_heads():
    """Granite-4.0-H-small: n_groups = 1, so every rank keeps B and C whole (vllm #55208)."""
    spec = preset("granite-4.0-h-small")
    x_len = 128 * 64
    for rank in range(4):
        conv = shard(spec, 4, rank).tensor("conv")
        x = (rank * x_len // 4, (rank + 1) * x_len // 4)
        assert conv.pieces == (x, (x_len, x_len + 128), (x_len + 128, x_len + 256))
    assert replicated_parts(spec, 4) == ("conv.B", "conv.C")


def test_fewer_kv_heads_than_ranks_are_replicated_by_the_heads_each_rank_serves():
    """Qwen3-Next: 2 KV heads at TP 8. Rank r's query heads use KV head r // 4, not r % 2."""
    spec = preset("qwen3-next-80b-a3b")
    assert [shard(spec, 8, r).tensor("k").pieces for r in range(8)] == [((0, 1),)] * 4 + [((1, 2),)] * 4
    assert replicated_parts(spec, 8) == ("k", "v")
    # the gated-delta-net conv splits q and k by key heads (16 x 128), v by value heads (32 x 128)
    assert shard(spec, 8, 1).tensor("conv").pieces == ((256, 512), (2304, 2560), (4608, 5120))
    assert shard(spec, 8, 1).tensor("ssm").pieces == ((4, 8),)


@pytest.mark.parametrize("name", list(TP_CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_the_ranks_hold_every_coordinate_and_replicate_only_what_is_named(name, tp):
    spec = tp_spec(name)
    replicated = replicated_parts(spec, tp)
    for tensor in spec.shard_table.tensors:
        held = [p for rank in range(tp) for p in shard(spec, tp, rank).tensor(tensor.name).pieces]
        covered = sorted(set(held))
        count = {piece: held.count(piece) for piece in covered}
        for segment_start, segment in _segments(tensor):
            copies = tp // segment.count if segment.replicated_at(tp) else 1
            pieces = [p for p in covered if segment_start <= p[0] < segment_start + segment.length]
            assert sum(b - a for a, b in pieces) == segment.length  # every coordinate, once per copy
            assert all(count[p] == copies for p in pieces)
            assert (copies > 1) == (tensor.part_name(segment) in replicated)


def _segments(tensor):
    start = 0
    for segment in tensor.rule.segments:
        yield start, segment
        start += segment.length


@pytest.mark.parametrize(
    "name,tp,message",
    [
        ("falcon-h1-7b", 8, "its 12 query heads do not divide by 8"),
        ("nemotron-h-8b", 3, "its 32 query heads do not divide by 3"),
        ("jamba-v0.1", 64, "its 32 query heads do not divide by 64"),
    ],
)
def test_presets_that_cannot_shard_are_refused_naming_the_heads(name, tp, message):
    with pytest.raises(TpUnshardable) as raised:
        check_tp(preset(name), tp)
    assert raised.value.tp == tp and message in raised.value.reason
    assert raised.value.valid_sizes == tuple(valid_tp_sizes(preset(name)))
    assert tp not in raised.value.valid_sizes


def _config(**fields):
    return TP_CONFIGS["mamba2_groups8"] | fields


@pytest.mark.parametrize(
    "config,tp,facts",
    [
        (
            _config(mamba_num_heads=12, num_attention_heads=12, num_key_value_heads=2, n_groups=4),
            6,
            (4, "groups"),
        ),
        (_config(mamba_num_heads=6), 4, (6, "Mamba heads")),
        (_config(num_key_value_heads=3, num_attention_heads=12), 4, (3, "KV heads")),
        (TP_CONFIGS["gdn_kv2"] | {"linear_num_key_heads": 2}, 4, (2, "key heads")),
        (TP_CONFIGS["gdn_kv2"] | {"num_attention_heads": 6}, 4, (6, "query heads")),
        (TP_CONFIGS["gdn_kv2"] | {"linear_num_value_heads": 6}, 4, (6, "value heads")),
    ],
    ids=["groups", "mamba-heads", "kv-heads", "key-heads", "query-heads", "value-heads"],
)
def test_what_cannot_shard_is_refused_in_one_line(config, tp, facts):
    spec = spec_from_hf(config)
    with pytest.raises(TpUnshardable) as raised:
        shard(spec, tp, 0)
    assert (raised.value.tp, raised.value.count, raised.value.unit) == (tp, *facts)
    assert "\n" not in str(raised.value)
    assert tp not in valid_tp_sizes(spec)


def test_a_state_without_a_rule_shards_only_at_tp_one():
    spec = make_spec()  # hand-built: no shard rules for its state
    assert shard(spec, 1, 0).spec is spec
    with pytest.raises(TpUnshardable) as raised:
        shard(spec, 2, 0)
    assert (raised.value.unit, raised.value.count, raised.value.valid_sizes) == ("conv", None, (1,))
    for call, facts in (
        (lambda: shard(tp_spec("gdn_kv2"), 2, 2), ("rank", 2, "in 0..1 for TP 2")),
        (lambda: check_tp(spec, 0), ("tp", 0, "a positive integer")),
    ):
        with pytest.raises(ShardArgInvalid) as invalid:
            call()
        assert (invalid.value.field, invalid.value.value, invalid.value.expected) == facts
