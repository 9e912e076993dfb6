"""Free runs of one band: coalescing, takes from either end, best-fit extents, watermarks."""

from __future__ import annotations

import numpy as np

from distpool.memory.arena.free_runs import FreeRuns


def _runs(runs: FreeRuns) -> list[tuple[int, int]]:
    return list(zip(runs.starts.tolist(), runs.ends.tolist(), strict=True))


def _owned(num_positions: int, owned: list[int]) -> np.ndarray:
    mask = np.zeros(num_positions, dtype=bool)
    mask[owned] = True
    return mask


def test_runs_are_the_free_stretches_and_give_coalesces_with_both_neighbours():
    runs = FreeRuns.from_owned(_owned(12, [2, 3, 4, 7, 8, 11]))
    assert _runs(runs) == [(0, 2), (5, 7), (9, 11)] and runs.num_free == 6
    assert (runs.lowest_owned(), runs.highest_owned()) == (2, 11)
    runs.give(np.array([8, 4, 3, 7]))  # 3, 4 extend [5, 7) down; 7, 8 bridge it to [9, 11)
    assert _runs(runs) == [(0, 2), (3, 11)] and runs.num_free == 10
    assert runs.matches(_owned(12, [2, 11]))
    runs.give(np.array([2, 11]))
    assert _runs(runs) == [(0, 12)] and runs.lowest_owned() is None and runs.highest_owned() is None


def test_takes_from_either_end_cross_runs_and_keep_the_rest():
    runs = FreeRuns.from_owned(_owned(10, [3, 4, 8]))  # free: [0, 3) [5, 8) [9, 10)
    assert runs.take_lowest(4).tolist() == [0, 1, 2, 5]
    assert runs.take_highest(2, lo=6).tolist() == [9, 7]  # descending, nothing below 6
    assert _runs(runs) == [(6, 7)] and runs.num_free == 1
    assert runs.matches(_owned(10, [0, 1, 2, 3, 4, 5, 7, 8, 9]))


def test_an_extent_takes_the_best_fit_at_the_low_end_of_a_hole_and_the_top_of_the_gap():
    # free: the open gap [0, 4), holes [6, 9) (3) and [11, 13) (2), position 14
    runs = FreeRuns.from_owned(_owned(16, [4, 5, 9, 10, 13, 15]))
    assert runs.take_extent(2, lo=1) == [(11, 2)]  # the smallest run holding 2: exactly [11, 13)
    assert runs.take_extent(2, lo=1) == [(6, 2)]  # then [6, 9), at its low end: 8 stays after it
    assert runs.take_extent(2, lo=1) == [(2, 2)]  # the gap [1, 4) usable: packed against 4
    runs.finish_batch()
    assert _runs(runs) == [(0, 2), (8, 9), (14, 15)]


def test_an_extent_without_a_run_large_enough_uses_the_largest_runs_in_address_order():
    runs = FreeRuns.from_owned(_owned(16, [0, 4, 5, 9, 10, 13, 15]))  # [1, 4) [6, 9) [11, 13) [14, 15)
    assert runs.take_extent(5, lo=0) == [(1, 3), (6, 2)]  # 3 + 2 from the two largest, ascending
    runs.finish_batch()
    assert _runs(runs) == [(8, 9), (11, 13), (14, 15)] and runs.num_free == 4


def test_growth_in_place_takes_from_the_start_of_the_run_after_each_request():
    runs = FreeRuns.from_owned(_owned(12, [0, 1, 4, 5, 6, 9]))  # [2, 4) [7, 9) [10, 12)
    taken = runs.take_after(np.array([2, 7, 10, 12]), np.array([3, 1, 2, 1]))
    assert taken.tolist() == [2, 1, 2, 0]  # 2 of 3 fit after the first; 12 is past the band
    runs.finish_batch()
    assert _runs(runs) == [(8, 9)]
    assert runs.take_after(np.array([5]), np.array([1])).tolist() == [0]  # 5 is owned


def test_an_extent_leaves_the_gap_to_the_other_band_while_the_holes_can_take_it():
    owned = _owned(16, [8, 11, 14, 15])  # the gap [0, 8) (usable from 2), holes [9, 11) and [12, 14)
    assert FreeRuns.from_owned(owned).take_extent(2, lo=2, gap_keep=4) == [(12, 2)]  # a hole, not the gap
    squeezed = FreeRuns.from_owned(owned)
    # The gap would keep only 3 and no hole holds 3: the gap still takes it whole (scattering over
    # the holes is the last resort; the next slot compacts the few pages in its way).
    assert squeezed.take_extent(3, lo=2, gap_keep=4) == [(5, 3)]
    roomy = FreeRuns.from_owned(owned)
    assert roomy.take_extent(3, lo=2, gap_keep=3) == [(5, 3)]  # 3 left in the gap: one piece
    tight = FreeRuns.from_owned(owned)
    assert tight.take_extent(5, lo=2, gap_keep=4) == [(3, 5)]  # the holes hold only 4: the gap


def _claims(size: int, at: dict[int, int]) -> np.ndarray:
    claims = np.zeros(size + 1, dtype=np.int64)
    for position, pages in at.items():
        claims[position] = pages
    return claims


def test_an_extent_stays_out_of_other_requests_growth_room_while_it_can():
    # holes [4, 10) (its first 3 claimed by the request ending at 3) and [12, 14); no gap (0 owned)
    runs = FreeRuns.from_owned(_owned(16, [0, 1, 2, 3, 10, 11, 14, 15]))
    claims = _claims(16, {4: 3})
    assert runs.take_extent(2, lo=0, claims=claims) == [(12, 2)]  # [4, 10) has only 3 unclaimed
    assert runs.take_extent(3, lo=0, claims=claims) == [(7, 3)]  # right after the claim: a split
    runs.finish_batch()
    assert _runs(runs) == [(4, 7)]  # the claimed room is still free


def test_an_extent_keeps_its_own_room_free_after_it():
    runs = FreeRuns.from_owned(_owned(16, [0, 1, 2, 3, 10, 11, 14, 15]))  # holes [4, 10) and [12, 14)
    assert runs.take_extent(2, lo=0, room=3, claims=_claims(16, {})) == [(4, 2)]  # 2 + 3 fit only there
    gap = FreeRuns.from_owned(_owned(16, [12, 13, 14, 15]))  # the gap [0, 12), usable from 2
    assert gap.take_extent(3, lo=2, room=2, claims=_claims(16, {})) == [(7, 3)]  # 2 left below the top
    assert _runs(gap) == [(0, 7), (10, 12)]


def test_when_only_claimed_room_is_left_an_extent_takes_the_least_of_it_from_the_top():
    # holes [4, 8) (all claimed) and [10, 14) (1 of 4 claimed); no gap
    runs = FreeRuns.from_owned(_owned(16, [0, 1, 2, 3, 8, 9, 14, 15]))
    claims = _claims(16, {4: 4, 10: 1})
    assert runs.take_extent(4, lo=0, claims=claims) == [(10, 4)]  # overlaps 1 claimed page, not 4
    runs = FreeRuns.from_owned(_owned(16, [0, 1, 2, 3, 8, 9, 14, 15]))
    assert runs.take_extent(2, lo=0, claims=_claims(16, {4: 4, 10: 4})) == [(12, 2)]  # the top of the
    # smallest hole: the claimant keeps the start of its room
