"""The pure plan: pairing rows, merging what is contiguous on both sides, cutting messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distpool.memory.pool import HeldPagesInvalid
from transfer import TransferOptions
from transfer.plans import (
    BAD_SHAPE,
    EMPTY,
    NEGATIVE,
    OVERLAPPING,
    PAST_ARENA,
    RangesRefused,
    RowsDoNotPair,
)
from transfer.plans.messages import MessagePlan, plan_messages
from transfer.plans.plan import DST, NBYTES, SRC, check_ranges, moving_rows, plan_runs


def table(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def stream_of(runs: torch.Tensor, side: int) -> list[tuple[int, int]]:
    """Byte ranges a side touches, in stream order (for comparing plans byte by byte)."""
    return [(int(r[side]), int(r[2])) for r in runs]


def expand(ranges: list[tuple[int, int]]) -> list[int]:
    return [b for offset, n in ranges for b in range(offset, offset + n)]


def test_contiguous_on_both_sides_is_one_run():
    src = table([[0, 100], [100, 100], [200, 50]])
    dst = table([[1000, 100], [1100, 100], [1200, 50]])
    assert plan_runs(src, dst).tolist() == [[0, 1000, 250]]


def test_merges_only_where_both_sides_continue():
    # rows 0-1 contiguous on both; row 2 breaks on the source; rows 2-3 contiguous on both again;
    # row 4 continues the source but not the destination.
    src = table([[0, 10], [10, 10], [50, 10], [60, 10], [70, 10]])
    dst = table([[100, 10], [110, 10], [120, 10], [130, 10], [500, 10]])
    assert plan_runs(src, dst).tolist() == [[0, 100, 20], [50, 120, 20], [70, 500, 10]]


def test_worst_case_fragmentation_keeps_every_row():
    g = torch.Generator().manual_seed(0)
    n, page = 4096, 64
    src_ids, dst_ids = torch.randperm(8192, generator=g)[:n], torch.randperm(8192, generator=g)[:n]
    src = torch.stack([src_ids * page, torch.full((n,), page)], dim=1)
    dst = torch.stack([dst_ids * page, torch.full((n,), page)], dim=1)
    runs = plan_runs(src, dst)
    # A random permutation leaves a handful of accidental neighbours; each merged run joins rows
    # that continue on both sides, and nothing is lost or reordered.
    assert 3900 <= runs.shape[0] <= n
    assert int(runs[:, 2].sum()) == n * page
    assert expand(stream_of(runs, 0)) == expand([(int(o), page) for o in src[:, 0]])
    assert expand(stream_of(runs, 1)) == expand([(int(o), page) for o in dst[:, 0]])


def test_descending_pages_never_merge():
    src = table([[300, 100], [200, 100], [100, 100]])
    dst = table([[0, 100], [100, 100], [200, 100]])
    assert plan_runs(src, dst).shape[0] == 3


def test_refuses_tables_that_do_not_pair():
    with pytest.raises(RowsDoNotPair) as counts:
        plan_runs(table([[0, 1], [1, 1]]), table([[0, 1], [1, 1], [2, 1]]))
    assert (counts.value.src_rows, counts.value.dst_rows, counts.value.row) == (2, 3, None)
    with pytest.raises(RowsDoNotPair) as sizes:
        plan_runs(table([[0, 8], [8, 8]]), table([[0, 8], [8, 9]]))
    assert (sizes.value.row, sizes.value.src_bytes, sizes.value.dst_bytes) == (1, 8, 9)


@pytest.mark.parametrize(
    "rows, problem",
    [
        ([[0, 10], [5, 10]], OVERLAPPING),
        ([[0, 10], [95, 10]], PAST_ARENA),
        ([[-1, 10]], NEGATIVE),  # a negative offset
        ([[0, 0]], NEGATIVE),  # a non-positive nbytes
    ],
)
def test_check_ranges_refuses_bad_tables(rows, problem):
    with pytest.raises(RangesRefused) as refused:
        check_ranges(table(rows), 100)
    assert (refused.value.name, refused.value.problem) == ("ranges", problem)
    if problem == PAST_ARENA:
        assert (refused.value.reach, refused.value.arena_bytes) == (105, 100)


def test_check_ranges_refuses_wrong_shape_and_empty():
    with pytest.raises(RangesRefused) as shape:
        check_ranges(torch.zeros(3, 3, dtype=torch.int64), 100)
    assert (shape.value.problem, shape.value.shape) == (BAD_SHAPE, "(3, 3) torch.int64")
    with pytest.raises(RangesRefused) as empty:
        check_ranges(torch.zeros(0, 2, dtype=torch.int64), 100)
    assert empty.value.problem == EMPTY
    assert isinstance(empty.value, ValueError)  # callers that catch ValueError still do


def test_small_runs_are_batched_into_one_staged_message_per_chunk():
    # 10 runs of 100 bytes, chunks of 350 bytes: the stream is cut at 350 and 700.
    runs = torch.stack(
        [torch.arange(10) * 1000, torch.arange(10) * 500, torch.full((10,), 100)], dim=1
    ).numpy()
    chunks = plan_messages(runs, chunk_bytes=350, direct_min_bytes=1000)
    assert [c.nbytes for c in chunks] == [350, 350, 300]
    assert all(len(c.messages) == 1 for c in chunks)
    first = chunks[0].messages[0]
    assert not first.is_direct
    assert first.pieces.tolist() == [[0, 0, 100], [1000, 500, 100], [2000, 1000, 100], [3000, 1500, 50]]
    # The run cut at 350 continues in chunk 1 from its 51st byte, on both sides.
    assert chunks[1].messages[0].pieces[0].tolist() == [3050, 1550, 50]


def test_big_runs_go_direct_and_are_split_at_chunk_boundaries():
    runs = table([[0, 0, 250], [1000, 5000, 40], [2000, 9000, 260]]).numpy()
    chunks = plan_messages(runs, chunk_bytes=200, direct_min_bytes=200)
    layout = [[(m.is_direct, m.pieces.tolist()) for m in c.messages] for c in chunks]
    assert layout == [
        [(True, [[0, 0, 200]])],
        # the small run is staged; the big runs' pieces in this window are direct
        [(True, [[1000, 5000, 40]]), (True, [[200, 200, 50]]), (True, [[2000, 9000, 110]])],
        [(True, [[2110, 9110, 150]])],
    ]
    assert sum(c.nbytes for c in chunks) == 550


def test_staged_and_direct_pieces_of_one_chunk():
    runs = table([[0, 0, 10], [100, 100, 500], [700, 700, 10], [900, 900, 10]]).numpy()
    (chunk,) = plan_messages(runs, chunk_bytes=1 << 20, direct_min_bytes=100)
    assert [(m.is_direct, m.pieces.tolist()) for m in chunk.messages] == [
        (False, [[0, 0, 10], [700, 700, 10], [900, 900, 10]]),
        (True, [[100, 100, 500]]),
    ]


def test_each_side_moves_a_batch_in_place_where_it_is_contiguous_there():
    # Pages scattered at the source, back to back at the destination: batched, in place at DST only.
    runs = table([[3000, 0, 100], [1000, 100, 100], [5000, 200, 100]]).numpy()
    ((message,),) = [c.messages for c in plan_messages(runs, chunk_bytes=1 << 20, direct_min_bytes=1000)]
    assert (message.in_place_at(SRC), message.in_place_at(DST)) == (None, 0)
    swapped = runs[:, [DST, SRC, NBYTES]]
    ((message,),) = [c.messages for c in plan_messages(swapped, chunk_bytes=1 << 20, direct_min_bytes=1000)]
    assert (message.in_place_at(SRC), message.in_place_at(DST)) == (0, None)
    # A direct message is in place on both sides; a batch contiguous on neither is staged on both.
    runs = table([[0, 900, 10], [500, 100, 500], [700, 0, 10]]).numpy()
    staged, direct = plan_messages(runs, chunk_bytes=1 << 20, direct_min_bytes=100)[0].messages
    assert (staged.in_place_at(SRC), staged.in_place_at(DST)) == (None, None)
    assert (direct.in_place_at(SRC), direct.in_place_at(DST)) == (500, 100)


def test_long_runs_beside_short_ones_go_zero_copy_and_only_the_short_ones_are_staged():
    """A resharded envelope's shape: 2 MiB halves of a state among 1 KiB KV-head slices, the source
    back to back, the destination interleaved. Sent as one batch, the destination would scatter
    every byte; at the CPU default the halves go straight from and into the arenas instead."""
    sizes = [2 << 20, *[1 << 10] * 64, 2 << 20, *[1 << 10] * 64]
    src = np.cumsum([0, *sizes[:-1]])
    dst = np.arange(len(sizes)) * (3 << 20)  # every piece somewhere else
    runs = np.stack([src, dst, sizes], axis=1).astype(np.int64)
    cpu_default = TransferOptions().direct_min_bytes_for(torch.device("cpu"))
    (chunk,) = plan_messages(runs, chunk_bytes=32 << 20, direct_min_bytes=cpu_default)
    staged, *direct = chunk.messages
    assert [m.pieces.tolist() for m in direct] == [[runs[0].tolist()], [runs[65].tolist()]]
    assert staged.nbytes == 128 << 10 and staged.pieces.shape[0] == 128
    assert (staged.in_place_at(SRC), staged.in_place_at(DST)) == (None, None)


def test_a_batch_in_place_on_one_side_stays_whole_when_splitting_would_copy_more():
    # Contiguous source: one batch copies its 120 bytes once (the scatter). Sending the 100-byte
    # run alone would cost two messages and leave a gap in the batch: its 20 bytes staged on both
    # sides. At 100 bytes a message: 100 + 120 against 200 + 40.
    runs = table([[0, 0, 10], [10, 1000, 100], [110, 2000, 10]]).numpy()
    ((message,),) = [c.messages for c in plan_messages(runs, chunk_bytes=1 << 20, direct_min_bytes=100)]
    assert message.pieces.tolist() == runs.tolist()
    assert (message.in_place_at(SRC), message.in_place_at(DST)) == (0, None)
    # Where the batch is in place on neither side, the long run goes alone (200 + 40 < 100 + 240).
    scattered = table([[500, 0, 10], [10, 1000, 100], [0, 2000, 10]]).numpy()
    staged, direct = plan_messages(scattered, chunk_bytes=1 << 20, direct_min_bytes=100)[0].messages
    assert direct.pieces.tolist() == [[10, 1000, 100]] and staged.pieces.shape[0] == 2


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000, 1 << 20])
@pytest.mark.parametrize("direct_min_bytes", [1, 50, 1 << 30])
def test_messages_cover_every_byte_once_in_order(chunk_bytes, direct_min_bytes):
    g = torch.Generator().manual_seed(chunk_bytes + direct_min_bytes)
    nbytes = torch.randint(1, 120, (40,), generator=g)
    src = torch.randperm(40, generator=g) * 200
    dst = torch.randperm(40, generator=g) * 300
    runs = plan_runs(torch.stack([src, nbytes], 1), torch.stack([dst, nbytes], 1))
    chunks = plan_messages(runs, chunk_bytes=chunk_bytes, direct_min_bytes=direct_min_bytes)
    assert all(c.nbytes <= chunk_bytes for c in chunks)
    assert sum(1 for c in chunks for m in c.messages if not m.is_direct and m.pieces.shape[0] > 1) <= len(
        chunks
    )
    # Concatenating every chunk's pieces (staged first, then direct, per chunk) covers each byte
    # of both sides once; within a chunk the order differs from the stream only by grouping.
    src_bytes = sorted(expand([(int(p[0]), int(p[2])) for c in chunks for m in c.messages for p in m.pieces]))
    dst_bytes = sorted(expand([(int(p[1]), int(p[2])) for c in chunks for m in c.messages for p in m.pieces]))
    assert src_bytes == sorted(expand(stream_of(runs, 0)))
    assert dst_bytes == sorted(expand(stream_of(runs, 1)))
    # And every piece pairs source and destination bytes at the same stream position.
    position = {b: i for i, b in enumerate(expand(stream_of(runs, 0)))}
    dst_stream = expand(stream_of(runs, 1))
    for c in chunks:
        for m in c.messages:
            for s, d, n in m.pieces.tolist():
                assert dst_stream[position[s]] == d
                assert position[s + n - 1] - position[s] == n - 1
    # A message is in place on a side exactly when its pieces follow each other there.
    for c in chunks:
        for m in c.messages:
            for side in (SRC, DST):
                offsets, sizes = m.pieces[:, side].tolist(), m.pieces[:, NBYTES].tolist()
                ends = [o + n for o, n in zip(offsets, sizes, strict=True)]
                follows = ends[:-1] == offsets[1:]
                assert m.in_place_at(side) == (offsets[0] if follows else None)


def test_streams_carry_even_shares_of_the_bytes_whatever_the_message_sizes():
    runs = np.array([[0, 0, 49 << 20], [100 << 20, 100 << 20, 15 << 20]], dtype=np.int64)  # a slot, a run
    plan = MessagePlan(runs, chunk_bytes=32 << 20, direct_min_bytes=1 << 20, num_streams=2)
    loads = [0, 0]
    for chunk in plan:
        for message, stream in zip(chunk.messages, plan.streams(chunk.index), strict=True):
            loads[stream] += message.nbytes
    # Taking turns would put 32 + 15 MiB on one stream and 17 + 0 on the other (or worse).
    assert sorted(loads) == [32 << 20, 32 << 20]
    one = MessagePlan(runs, chunk_bytes=32 << 20, direct_min_bytes=1 << 20)
    assert [one.streams(i) for i in range(len(one))] == [[0] * len(c.messages) for c in one]


@pytest.mark.parametrize("seed", range(6))
def test_a_message_plan_plans_a_chunk_when_asked_and_equals_the_whole_plan(seed):
    rng = np.random.default_rng(seed)
    nbytes = rng.integers(1, 3000, 60)
    src, dst = rng.permutation(60) * 4000, rng.permutation(60) * 5000
    runs = plan_runs(torch.tensor(np.stack([src, nbytes], 1)), torch.tensor(np.stack([dst, nbytes], 1)))
    sizes = {"chunk_bytes": int(rng.integers(500, 20000)), "direct_min_bytes": int(rng.integers(100, 4000))}
    whole = plan_messages(runs, **sizes)
    plan, in_order = MessagePlan(runs, **sizes, num_streams=3), MessagePlan(runs, **sizes, num_streams=3)
    streams = [in_order.streams(i) for i in range(len(in_order))]

    def facts(chunks):  # a chunk's messages hold arrays: compare what they say
        return [(c.index, [(m.pieces.tolist(), m.nbytes, m.spans) for m in c.messages]) for c in chunks]

    assert len(plan) == len(whole) > 2 and plan.planned == 0
    assert facts([plan[0]]) == facts(whole[:1]) and plan.planned == 1  # before the rest is planned
    last = len(plan) - 1
    assert plan.streams(last) == streams[last] and plan.planned == len(plan)  # asked for last first
    assert facts(plan) == facts(whole) == facts(plan[:]) and facts([plan[-1]]) == facts(whole[-1:])
    assert [plan.streams(i) for i in range(len(plan))] == streams and len(set(sum(streams, []))) > 1
    with pytest.raises(IndexError):
        plan[len(plan)]
    empty = MessagePlan(np.zeros((0, 3), dtype=np.int64), **sizes)
    assert len(empty) == 0 and list(empty) == []
    with pytest.raises(ValueError, match="num_streams"):
        MessagePlan(runs, **sizes, num_streams=0)


def test_moving_rows_drop_the_held_pages_and_keep_the_slot_first():
    rows = table([[0, 8], [100, 4], [104, 4], [200, 4], [300, 4]])  # slot, then 4 pages
    assert moving_rows(rows, 2, has_slot=True).tolist() == [[0, 8], [200, 4], [300, 4]]
    assert moving_rows(rows, 0, has_slot=True) is rows
    assert moving_rows(rows.numpy(), 4, has_slot=True).tolist() == [[0, 8]]  # numpy tables too
    assert moving_rows(rows, 2, has_slot=False).tolist() == [[104, 4], [200, 4], [300, 4]]
    for held in (-1, 5):  # a hostile READY cannot make either end skip the slot or invent pages
        with pytest.raises(HeldPagesInvalid) as err:
            moving_rows(rows, held, has_slot=True)
        assert (err.value.held_pages, err.value.pages) == (held, 4)


def test_a_batch_scattered_on_both_sides_goes_as_stretches_of_one_side_where_that_copies_less():
    """KV-head slices as TP 2 -> 1 moves them: at the source two stretches of back-to-back slices,
    at the destination every slice apart. One batch would copy its 2,000 bytes on both sides;
    two messages in place at the source copy them once (at the destination): 2 x 100 + 2,000
    against 100 + 4,000."""
    src = np.concatenate([np.arange(20) * 50, 10_000 + np.arange(20) * 50])
    dst = np.arange(40) * 300
    runs = np.stack([src, dst, np.full(40, 50)], axis=1).astype(np.int64)
    (chunk,) = plan_messages(runs, chunk_bytes=1 << 20, direct_min_bytes=100)
    assert [(m.in_place_at(SRC), m.in_place_at(DST), m.pieces.shape[0]) for m in chunk.messages] == [
        (0, None, 20),
        (10_000, None, 20),
    ]
    assert chunk.staging_offsets(SRC) == [None, None] and chunk.staging_offsets(DST) == [0, 1000]
    # Where the extra message costs as much as the bytes a split saves, the batch stays whole.
    (chunk,) = plan_messages(runs, chunk_bytes=1 << 20, direct_min_bytes=2000)
    ((at_src, at_dst),) = [(m.in_place_at(SRC), m.in_place_at(DST)) for m in chunk.messages]
    assert (at_src, at_dst) == (None, None)


def test_a_doubly_staged_batch_sends_its_long_stretches_alone_and_keeps_its_short_ones_batched():
    """TP 2 -> 1's slot and pages in one chunk: 24-byte conv halves, one after each zero-copy state
    half (taken out: they leave the halves apart on both sides), then a long stretch of slices
    back to back at the source, interleaved at the destination. The long stretch goes alone,
    staged at the destination only; the conv halves stay one batch, staged on both sides (a
    message each would cost more than copying them twice)."""
    conv = [(i * 1000, 50_000 + i * 2000, 24) for i in range(6)]
    states = [(i * 1000 + 24, 50_000 + i * 2000 + 48, 900) for i in range(6)]
    slot = [run for pair in zip(conv, states, strict=True) for run in pair]
    slices = [(6000 + i * 10, 90_000 + i * 20, 10) for i in range(40)]  # 400 bytes, one stretch at SRC
    runs = np.array(slot + slices, dtype=np.int64)
    (chunk,) = plan_messages(runs, chunk_bytes=1 << 20, direct_min_bytes=200)
    shapes = [(m.pieces.shape[0], m.in_place_at(SRC), m.in_place_at(DST)) for m in chunk.messages]
    assert shapes == [(6, None, None), (40, 6000, None)] + [(1, s, d) for s, d, _ in states]
    assert chunk.staging_offsets(SRC) == [0, None] + [None] * 6
    assert chunk.staging_offsets(DST) == [0, 6 * 24] + [None] * 6
