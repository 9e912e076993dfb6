"""Random TP run tables, byte-exact through the data path the engines take, for every TP test config
and both directions (A:B and B:A).

Each example places one request's units anew on every rank (a random number of other requests
reserved first, a random prompt length: the last page partly filled), takes every channel's runs
from `plan_pair` and moves them as the pipelines do (`plan_messages` with a random chunk size, so
runs straddle chunk boundaries, and a random zero-copy threshold; each message sent from the arena
where it lies contiguous at the source, else gathered; landed in place where contiguous at the
destination, else scattered). Every destination arena must then equal what a copy per run gives,
byte for byte, outside the envelope as well. No channel is needed: the engines' own exchanges are
covered by test_tp_transfer and test_run_tables; this covers the plans and copies they run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distpool.memory.arena import merge_runs
from tests.factories import TP_CONFIGS, make_rank_pool, tp_spec
from tests.transfer.test_reshard import PAGE_SIZE, layout, units_of
from transfer.ends.staging import gather, scatter
from transfer.plans.messages import plan_messages
from transfer.plans.plan import DST, NBYTES, SRC
from transfer.plans.reshard import EnvelopeUnits, _unit_bytes, plan_pair, source_ranks
from transfer.plans.unit_templates import UNIT_KINDS, unit_templates

DIRECTIONS = [(1, 2), (2, 1), (2, 4), (4, 2)]


def placed_pools(shards, others: list[int], tokens: int, seed: int) -> list:
    """Each rank's pool: `others[r]` requests of varying length first, then the request "r", and
    random bytes in every arena."""
    pools = []
    for shard_, count in zip(shards, others, strict=True):
        pool = make_rank_pool(shard_, unified=True)
        for i in range(count):
            pool.reserve(f"other{i}", 1 + 3 * i)
        pool.reserve("r", tokens)
        generator = torch.Generator().manual_seed(seed + shard_.rank)
        pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=generator))
        pools.append(pool)
    return pools


def move_as_the_pipelines(runs, src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int, direct: int) -> None:
    for chunk in plan_messages(runs, chunk_bytes=chunk_bytes, direct_min_bytes=direct):
        assert chunk.staged_bytes(SRC) <= chunk_bytes and chunk.staged_bytes(DST) <= chunk_bytes
        for message in chunk.messages:
            pieces, nbytes = message.pieces, message.nbytes
            at_src, at_dst = message.in_place_at(SRC), message.in_place_at(DST)
            if at_src is not None:
                payload = src[at_src : at_src + nbytes].clone()  # what goes on the wire
            else:
                payload = torch.empty(nbytes, dtype=torch.uint8)
                gather(src, pieces[:, SRC], pieces[:, NBYTES], payload)
            if at_dst is not None:
                dst[at_dst : at_dst + nbytes] = payload
            else:
                scatter(payload, pieces[:, DST], pieces[:, NBYTES], dst)


@pytest.mark.parametrize("src_tp,dst_tp", DIRECTIONS, ids=[f"{a}to{b}" for a, b in DIRECTIONS])
@pytest.mark.parametrize("model", list(TP_CONFIGS))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    tokens=st.integers(1, 13),
    chunk_bytes=st.sampled_from([64, 200, 1024, 4096, 1 << 20]),
    direct=st.sampled_from([1, 64, 512, 1 << 30]),
    seed=st.integers(0, 2**16),
)
def test_random_tp_run_tables_land_byte_exact_through_the_staged_and_direct_path(
    model, src_tp, dst_tp, data, tokens, chunk_bytes, direct, seed
):
    spec = tp_spec(model)
    src_shards, dst_shards = layout(spec, src_tp), layout(spec, dst_tp)
    others = st.lists(st.integers(0, 3), min_size=src_tp + dst_tp, max_size=src_tp + dst_tp)
    counts = data.draw(others)
    src_pools = placed_pools(src_shards, counts[:src_tp], tokens, seed)
    dst_pools = placed_pools(dst_shards, counts[src_tp:], tokens, seed + 100)
    moved = 0
    for d, dst_pool in enumerate(dst_pools):
        expected, actual = dst_pool.buffer.clone(), dst_pool.buffer.clone()
        for s in source_ranks(src_shards, dst_shards, d):
            runs = plan_pair(
                src_shards,
                units_of(src_pools[s], "r"),
                dst_shards,
                units_of(dst_pool, "r"),
                src_rank=s,
                dst_rank=d,
                page_size=PAGE_SIZE,
            )
            src = src_pools[s].buffer
            for s_off, d_off, n in runs.tolist():  # the reference: one copy per run
                expected[d_off : d_off + n] = src[s_off : s_off + n]
            move_as_the_pipelines(runs, src, actual, chunk_bytes, direct)
            moved += int(runs[:, NBYTES].sum())
        assert torch.equal(actual, expected), f"destination rank {d} differs from a copy per run"
    assert moved > 0


def placed_units(rank_shard, num_pages: int, draw) -> EnvelopeUnits:
    """One rank's units at drawn places: each unit right after the one before it (so that their
    runs may join across units), or after a gap, or elsewhere in the arena."""
    sizes = [_unit_bytes(rank_shard, kind, PAGE_SIZE) for kind in UNIT_KINDS]
    counts = [int(rank_shard.spec.mamba is not None), num_pages, 0]
    tables, at = [], draw(st.integers(0, 64))
    for size, count in zip(sizes, counts, strict=True):
        rows = []
        for _ in range(count):
            at = draw(st.sampled_from([at, at + 8, at + 10_000, draw(st.integers(0, 1 << 20)) * 8]))
            rows.append((at, size))
            at += size
        tables.append(np.asarray(rows, dtype=np.int64).reshape(-1, 2))
    return EnvelopeUnits(slot=tables[0], page=tables[1], swa_page=tables[2])


@pytest.mark.parametrize("src_tp,dst_tp", DIRECTIONS, ids=[f"{a}to{b}" for a, b in DIRECTIONS])
@pytest.mark.parametrize("model", list(TP_CONFIGS))
@settings(max_examples=10, deadline=None)
@given(data=st.data(), num_pages=st.integers(0, 6))
def test_a_pair_moves_its_shifted_unit_templates_merged_wherever_units_join(
    model, src_tp, dst_tp, data, num_pages
):
    """The reshard writes each unit's template shifted to the unit and merges only at the joints
    between units: the runs are exactly every template row shifted, in order, merged wherever a run
    continues the one before it on both sides (units placed back to back on both sides join)."""
    spec = tp_spec(model)
    src_shards, dst_shards = layout(spec, src_tp), layout(spec, dst_tp)
    for d, dst in enumerate(dst_shards):
        dst_units = placed_units(dst, num_pages, data.draw)
        for s in source_ranks(src_shards, dst_shards, d):
            src_units = placed_units(src_shards[s], num_pages, data.draw)
            runs = plan_pair(
                src_shards, src_units, dst_shards, dst_units, src_rank=s, dst_rank=d, page_size=PAGE_SIZE
            )
            templates = unit_templates(tuple(src_shards), dst, PAGE_SIZE)
            rows = [
                templates[s, kind] + np.array([src_at, dst_at, 0])
                for kind in UNIT_KINDS
                if (s, kind) in templates
                for src_at, dst_at in zip(
                    getattr(src_units, kind)[:, 0], getattr(dst_units, kind)[:, 0], strict=True
                )
            ]
            shifted = np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)
            expected = merge_runs(shifted[:, SRC], shifted[:, DST], shifted[:, NBYTES])
            assert runs.tolist() == expected.tolist()
