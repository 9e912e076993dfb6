"""The plan between two TP layouts, run in one process: prefill ranks fill their shards with the
synthetic pattern, the plan's runs are copied between the ranks' arenas, and every decode rank
verifies every byte of its shard. Then the engines' known bugs, put into the plan on purpose, are
each caught as corrupt."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from distpool.memory.arena_pool import ArenaPool
from distpool.memory.sizing import TensorPlace
from distpool.model.dtypes import dtype_bytes
from distpool.model.shard import RankShard, TensorShard, shard
from distpool.model_impl.synthetic.model import SyntheticCache
from tests.factories import TP_CONFIGS, make_pool, make_rank_pool, prefill_tokens, tp_spec
from transfer.plans import (
    DIFFERENT_MODELS,
    RANKS_NOT_IN_ORDER,
    UNIT_COUNTS_DIFFER,
    LayoutsDoNotPair,
    UnitSizesDiffer,
)
from transfer.plans.plan import plan_runs
from transfer.plans.reshard import EnvelopeUnits, PairPlanner, RankRuns, plan_pair, plan_reshard, source_ranks
from transfer.plans.unit_templates import _tensor_runs

PROMPT = [5, 3, 8, 1, 9, 2, 7, 4, 6, 0, 11]  # 11 tokens: three pages of 4, the last partly filled
PAGE_SIZE = 4
TP_PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2)]


def units_of(pool: ArenaPool, request_id: str) -> EnvelopeUnits:
    return EnvelopeUnits.from_ranges(
        pool.envelope_ranges(request_id),
        num_pages=len(pool.page_ids(request_id)),
        has_slot=pool.slot_id(request_id) is not None,
    )


def layout(spec, tp: int) -> list[RankShard]:
    return [shard(spec, tp, rank) for rank in range(tp)]


def prefill_ranks(spec, shards, *, unified: bool) -> tuple[list[ArenaPool], int]:
    """Each source rank's pool with the request prefilled (ranks placed differently: rank r first
    holds r small requests, so no two ranks' page tables agree); the first token."""
    pools, firsts = [], set()
    for shard_ in shards:
        pool = make_rank_pool(shard_, unified=unified)
        for i in range(shard_.rank):
            pool.reserve(f"filler{i}", 1 + 4 * i)
        cache = SyntheticCache(spec, seed=3, shard=shard_)
        pool.reserve("r", len(PROMPT))
        firsts.update(prefill_tokens(cache, pool, {"r": PROMPT}))
        pools.append(pool)
    assert len(firsts) == 1, "every rank computes the same first token"
    return pools, firsts.pop()


def destination_ranks(shards, *, unified: bool) -> list[ArenaPool]:
    pools = []
    for shard_ in shards:
        pool = make_rank_pool(shard_, unified=unified)
        for i in range(len(shards) - shard_.rank):  # placed unlike the source ranks
            pool.reserve(f"other{i}", 3 + 2 * i)
        pool.reserve("r", len(PROMPT))
        pools.append(pool)
    return pools


def plan_between(src_shards, src_pools, dst_shards, dst_pools) -> tuple[RankRuns, ...]:
    """The plan for request "r" from the source ranks' pools to the destination ranks'."""
    return plan_reshard(
        src_shards,
        [units_of(p, "r") for p in src_pools],
        dst_shards,
        [units_of(p, "r") for p in dst_pools],
        page_size=PAGE_SIZE,
    )


def execute(plan: tuple[RankRuns, ...], src_pools: list[ArenaPool], dst_pools: list[ArenaPool]) -> None:
    """The plan as copies between the ranks' arenas (the channels of a deployment, in one process)."""
    for step in plan:
        src, dst = src_pools[step.src_rank].buffer, dst_pools[step.dst_rank].buffer
        for s, d, n in step.runs.tolist():
            dst[d : d + n] = src[s : s + n]


def received_once(plan, dst_pools, dst_shards) -> None:
    """Each destination rank's runs land inside its envelope, write no byte twice, and add up to
    its shard of every unit."""
    for pool, shard_ in zip(dst_pools, dst_shards, strict=True):
        hits = np.zeros(pool.buffer.numel(), dtype=np.int64)
        runs = np.concatenate([p.runs for p in plan if p.dst_rank == shard_.rank])
        for _, d, n in runs.tolist():
            hits[d : d + n] += 1
        assert hits.max() == 1, "a destination byte is written twice"
        inside = np.zeros_like(hits)
        for offset, nbytes in pool.envelope_ranges("r").tolist():
            inside[offset : offset + nbytes] = 1
        assert (hits <= inside).all(), "a run writes outside the destination envelope"
        pages = len(pool.page_ids("r"))
        expected = shard_.slot_bytes + pages * PAGE_SIZE * shard_.kv_bytes_per_token
        assert int(hits.sum()) == expected


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "static"])
@pytest.mark.parametrize("src_tp,dst_tp", TP_PAIRS, ids=[f"{a}to{b}" for a, b in TP_PAIRS])
@pytest.mark.parametrize("model", list(TP_CONFIGS))
def test_every_destination_byte_verifies_after_resharding(model, src_tp, dst_tp, unified):
    spec = tp_spec(model)
    src_shards, dst_shards = layout(spec, src_tp), layout(spec, dst_tp)
    src_pools, first = prefill_ranks(spec, src_shards, unified=unified)
    dst_pools = destination_ranks(dst_shards, unified=unified)
    plan = plan_between(src_shards, src_pools, dst_shards, dst_pools)
    received_once(plan, dst_pools, dst_shards)
    execute(plan, src_pools, dst_pools)
    for pool, shard_ in zip(dst_pools, dst_shards, strict=True):
        cache = SyntheticCache(spec, seed=3, shard=shard_)
        assert cache.admit(pool, "r", PROMPT, first) is None
        pool.extend("r", 1)  # one decode step rewrites a stripe of the unsharded state on each rank
        cache.decode_step(pool, ["r"], [first])
        assert cache.check(pool, "r") is None
        pool.check_invariants()
    # every destination rank hears from the source ranks `source_ranks` names, and only them
    for dst in range(dst_tp):
        senders = tuple(sorted(p.src_rank for p in plan if p.dst_rank == dst))
        assert senders == source_ranks(src_shards, dst_shards, dst)


# ---- the engines' bugs, put into the plan on purpose: the destination's verification catches each
def broken(shards: list[RankShard], name: str, pieces_of) -> list[RankShard]:
    """`shards` with tensor `name` believed to be at `pieces_of(shard)` (unsharded axis ranges):
    what an engine with that bug reads or writes for it."""
    return [
        dataclasses.replace(
            s,
            tensors=tuple(
                dataclasses.replace(t, pieces=pieces_of(s)) if t.name == name else t for t in s.tensors
            ),
        )
        for s in shards
    ]


def transfer_with(spec, src_tp: int, dst_tp: int, planned_dst_shards=None):
    """Prefill at `src_tp`, plan against `planned_dst_shards` (default: the true layout), copy, and
    verify on every destination rank with its true shard: each rank's mismatch (None: verified)."""
    src_shards, dst_shards = layout(spec, src_tp), layout(spec, dst_tp)
    src_pools, first = prefill_ranks(spec, src_shards, unified=True)
    dst_pools = destination_ranks(dst_shards, unified=True)
    plan = plan_between(src_shards, src_pools, planned_dst_shards or dst_shards, dst_pools)
    execute(plan, src_pools, dst_pools)
    return [
        SyntheticCache(spec, seed=3, shard=s).admit(pool, "r", PROMPT, first)
        for s, pool in zip(dst_shards, dst_pools, strict=True)
    ]


@pytest.mark.parametrize("model", ["mamba2_groups8", "gdn_kv2"])
def test_a_conv_state_sliced_as_one_block_is_caught(model):
    """sglang #23746: a conv state of segments (Mamba2 x | B | C, gated delta net q | k | v) cut into
    TP equal blocks rather than segment by segment. Where every segment splits, a rank's block is
    as long as its true shard, so nothing fails but the bytes."""
    spec = tp_spec(model)
    conv_channels = spec.mamba.tensors[0].shape[0]
    one_block = broken(
        layout(spec, 2), "conv", lambda s: ((s.rank * conv_channels // 2, (s.rank + 1) * conv_channels // 2),)
    )
    assert transfer_with(spec, 1, 2) == [None, None]  # the true plan, for contrast
    mismatches = transfer_with(spec, 1, 2, one_block)
    for mismatch in mismatches:
        assert (mismatch.kind, mismatch.layer, mismatch.tensor) == ("state", spec.mamba_layers[0], "conv")


def test_replicated_groups_read_at_a_sharded_offset_are_caught():
    """vllm #55208: with n_groups = 1, B was located as if it were split across TP, so at prefill
    TP 1 -> decode TP 2 the second rank read C as B. The first rank's bytes are right."""
    spec = tp_spec("mamba2_groups1")
    x, b, c = spec.mamba.shard_rules[0].segments
    b_start = x.length

    def b_at_sharded_offset(s: RankShard) -> tuple[tuple[int, int], ...]:
        x_piece, _, c_piece = s.tensor("conv").pieces
        return x_piece, (b_start + s.rank * b.width, b_start + (s.rank + 1) * b.width), c_piece

    mismatches = transfer_with(spec, 1, 2, broken(layout(spec, 2), "conv", b_at_sharded_offset))
    assert mismatches[0] is None
    assert (mismatches[1].kind, mismatches[1].layer, mismatches[1].tensor) == ("state", 0, "conv")
    # the first wrong byte is the first byte of B: x of rank 1 is 16 channels of 3 bf16 values
    assert mismatches[1].byte_offset == (x.length // 2) * 3 * 2


def test_replicated_kv_heads_mapped_by_modulo_are_caught():
    """sglang #23746: with fewer KV heads than ranks, rank r needs KV head r // (tp / kv_heads) (the
    one its query heads use), not r % kv_heads. At TP 4 with 2 KV heads, ranks 1 and 2 differ."""
    spec = tp_spec("gdn_kv2")
    kv_heads = spec.full_attention.num_kv_heads

    def modulo(s: RankShard) -> tuple[tuple[int, int], ...]:
        return ((s.rank % kv_heads, s.rank % kv_heads + 1),)

    by_modulo = broken(broken(layout(spec, 4), "k", modulo), "v", modulo)
    mismatches = transfer_with(spec, 1, 4, by_modulo)
    assert mismatches[0] is None and mismatches[3] is None
    for mismatch in (mismatches[1], mismatches[2]):
        assert (mismatch.kind, mismatch.layer, mismatch.tensor, mismatch.position) == ("kv", 1, "k", 0)


# ---- the plan itself -------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
def test_equal_layouts_move_whole_units_rank_to_rank_as_the_one_rank_plan(tp):
    spec = tp_spec("mamba2_groups1")
    shards = layout(spec, tp)
    src_pools, _ = prefill_ranks(spec, shards, unified=True)
    dst_pools = destination_ranks(shards, unified=True)
    plan = plan_between(shards, src_pools, shards, dst_pools)
    assert [(p.src_rank, p.dst_rank) for p in plan] == [(r, r) for r in range(tp)]
    for step, src, dst in zip(plan, src_pools, dst_pools, strict=True):
        assert np.array_equal(step.runs, plan_runs(src.envelope_ranges("r"), dst.envelope_ranges("r")))


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_a_ranks_share_of_a_pages_k_or_v_is_one_run(src_tp, dst_tp):
    """A page keeps each K and V heads outermost: between TP 1 and 2, a rank pair moves one run per
    layer's K and V of each page (its heads' page_size tokens), not one per token."""
    spec = tp_spec("gdn_kv2")  # 2 KV heads of 8 dims, bfloat16; full attention at layers 1 and 3
    attn = spec.full_attention
    run_bytes = (attn.num_kv_heads // 2) * PAGE_SIZE * attn.head_dim * 2
    src_shards, dst_shards = layout(spec, src_tp), layout(spec, dst_tp)
    src_pools, _ = prefill_ranks(spec, src_shards, unified=True)
    dst_pools = destination_ranks(dst_shards, unified=True)
    plan = plan_between(src_shards, src_pools, dst_shards, dst_pools)
    pages = len(src_pools[0].page_ids("r"))
    for step in plan:
        kv = step.runs[step.runs[:, 2] == run_bytes]
        assert len(kv) == pages * 2 * len(spec.full_attention_layers)  # K and V of each layer, per page
    execute(plan, src_pools, dst_pools)
    received_once(plan, dst_pools, dst_shards)


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_a_ranks_share_of_a_state_tensor_is_one_run_across_every_layer(src_tp, dst_tp):
    """A slot keeps each state tensor's rows outermost across layers (`SLOT_ORDER`): between TP 1
    and 2, a rank pair moves its heads of every layer's SSM state as one run, and its channels of
    each conv segment (x | B | C) as one run each, not one run per layer."""
    spec = tp_spec("mamba2_groups8")  # every conv segment splits
    layers = len(spec.mamba_layers)
    assert layers > 1
    conv, ssm = spec.mamba.tensors
    src_shards, dst_shards = layout(spec, src_tp), layout(spec, dst_tp)
    src_pools, _ = prefill_ranks(spec, src_shards, unified=True)
    dst_pools = destination_ranks(dst_shards, unified=True)
    plan = plan_between(src_shards, src_pools, dst_shards, dst_pools)
    for step in plan:
        slot, nbytes = dst_pools[step.dst_rank].envelope_ranges("r")[0].tolist()
        runs = step.runs[(step.runs[:, 1] >= slot) & (step.runs[:, 1] < slot + nbytes)]
        row_bytes = conv.shape[1] * dtype_bytes(conv.dtype)
        segments = [s.length // 2 * row_bytes * layers for s in spec.mamba.shard_rules[0].segments]
        assert sorted(runs[:, 2].tolist()) == sorted([ssm.nbytes // 2 * layers, *segments])
    execute(plan, src_pools, dst_pools)
    received_once(plan, dst_pools, dst_shards)


def test_a_state_tensor_split_along_another_axis_than_its_first_is_refused_in_a_slot():
    """A slot keeps a state tensor's first axis outermost across layers: a rank's share is a run
    per row of it. A tensor split along another axis would need runs the slot does not lay out."""
    tensor = TensorShard(name="ssm", shape=(4, 8), dtype="float32", axis=1, pieces=((0, 4),))
    place = TensorPlace(layer=0, name="ssm", offset=0, nbytes=4 * 4 * 4, row_stride=2 * 4 * 4 * 4)
    with pytest.raises(ValueError, match="ssm is split along axis 1; a slot keeps the first one outermost"):
        _tensor_runs(tensor, tensor, place, place, 0, 4)


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (2, 4), (2, 2)])
def test_a_channels_planner_plans_each_envelope_without_looking_at_the_layouts_again(
    src_tp, dst_tp, monkeypatch
):
    """A pair's planner answers as `plan_pair` does, and per envelope neither hashes nor compares a
    shard (which, a model spec deep, took most of a plan's time)."""
    spec = tp_spec("mamba2_groups1")
    src_shards, dst_shards = layout(spec, src_tp), layout(spec, dst_tp)
    src_pools, _ = prefill_ranks(spec, src_shards, unified=True)
    dst_pools = destination_ranks(dst_shards, unified=True)
    for src_rank in range(src_tp):
        for dst_rank in range(dst_tp):
            ranks = {"src_rank": src_rank, "dst_rank": dst_rank, "page_size": PAGE_SIZE}
            planner = PairPlanner.of(src_shards, dst_shards, **ranks)
            units = (units_of(src_pools[src_rank], "r"), units_of(dst_pools[dst_rank], "r"))
            expected = plan_pair(src_shards, units[0], dst_shards, units[1], **ranks)

            def looked(*_):
                raise AssertionError("a layout was hashed or compared per envelope")

            with monkeypatch.context() as patched:
                patched.setattr(RankShard, "__hash__", looked)
                patched.setattr(RankShard, "__eq__", looked)
                runs = planner.runs(*units)
            assert np.array_equal(runs, expected)


def test_replicated_parts_come_from_a_source_rank_the_destination_hears_from_anyway():
    """At 4 -> 2 with one group, every source rank holds B and C; destination rank 1 takes them
    from source rank 2, which sends it x anyway, so it needs channels to ranks 2 and 3 only."""
    spec = tp_spec("mamba2_groups1")
    src, dst = layout(spec, 4), layout(spec, 2)
    assert [source_ranks(src, dst, d) for d in range(2)] == [(0, 1), (2, 3)]
    assert [source_ranks(dst, src, d) for d in range(4)] == [(0,), (0,), (1,), (1,)]
    assert source_ranks(layout(spec, 1), layout(spec, 4), 3) == (0,)


def test_held_pages_are_left_out_on_both_sides():
    spec = tp_spec("gdn_kv2")
    src_shards, dst_shards = layout(spec, 2), layout(spec, 1)
    src_pools, _ = prefill_ranks(spec, src_shards, unified=True)
    dst_pools = destination_ranks(dst_shards, unified=True)

    def units(pools, held):
        return [
            EnvelopeUnits.from_ranges(p.envelope_ranges("r"), num_pages=3, has_slot=True, held_pages=held)
            for p in pools
        ]

    whole = plan_reshard(
        src_shards, units(src_pools, 0), dst_shards, units(dst_pools, 0), page_size=PAGE_SIZE
    )
    less = plan_reshard(src_shards, units(src_pools, 2), dst_shards, units(dst_pools, 2), page_size=PAGE_SIZE)
    page_bytes = PAGE_SIZE * dst_shards[0].kv_bytes_per_token
    assert sum(p.nbytes for p in whole) - sum(p.nbytes for p in less) == 2 * page_bytes
    held = dst_pools[0].envelope_ranges("r")[1:3].tolist()  # the destination's first two pages
    for step in less:
        for _, d, n in step.runs.tolist():
            assert all(d + n <= start or d >= start + size for start, size in held)


def test_tables_that_do_not_pair_are_refused():
    spec = tp_spec("mamba2_groups1")
    src_shards, dst_shards = layout(spec, 1), layout(spec, 2)
    src_pools, _ = prefill_ranks(spec, src_shards, unified=True)
    short = make_rank_pool(dst_shards[0], unified=True)
    short.reserve("r", 4)  # one page where the source holds three
    dst_units = [units_of(short, "r"), units_of(short, "r")]
    with pytest.raises(LayoutsDoNotPair) as counts:
        plan_reshard(src_shards, [units_of(src_pools[0], "r")], dst_shards, dst_units, page_size=PAGE_SIZE)
    assert counts.value.problem == UNIT_COUNTS_DIFFER
    assert sorted(n for kind, n in counts.value.counts if kind == "page") == [1, 3]
    with pytest.raises(LayoutsDoNotPair) as order:
        plan_reshard(
            src_shards, [units_of(src_pools[0], "r")], dst_shards[::-1], dst_units, page_size=PAGE_SIZE
        )
    assert (order.value.problem, order.value.side) == (RANKS_NOT_IN_ORDER, "destination")
    other = layout(tp_spec("mamba2_groups8"), 2)
    with pytest.raises(LayoutsDoNotPair) as models:
        plan_reshard(src_shards, [units_of(src_pools[0], "r")], other, dst_units, page_size=PAGE_SIZE)
    assert models.value.problem == DIFFERENT_MODELS


def test_a_pool_not_built_from_its_shard_is_refused_naming_the_rank_and_sizes():
    """A rank pool sized with an fp8 KV override, planned with shards of the bf16 spec: the plan's
    offsets would miss; the unit sizes give it away."""
    spec = tp_spec("gdn_kv2")
    src_shards, dst_shards = layout(spec, 1), layout(spec, 2)
    src_pools, _ = prefill_ranks(spec, src_shards, unified=True)
    fp8 = [make_pool(s.spec, budget_bytes=64 << 10, context_len=32, kv_dtype="fp8_e4m3") for s in dst_shards]
    for pool in fp8:
        pool.reserve("r", len(PROMPT))
    with pytest.raises(UnitSizesDiffer) as differ:
        plan_between(src_shards, src_pools, dst_shards, fp8)
    error = differ.value
    assert (error.rank, error.tp, error.kind) == (0, 2, "page")
    assert error.expected == PAGE_SIZE * dst_shards[0].kv_bytes_per_token  # bf16: twice the fp8 pages
    assert error.sizes == [error.expected // 2]
