"""Targeted compaction plans (evacuate.py): who moves, where to, and in which order the copies run."""

from __future__ import annotations

import numpy as np

from distpool.memory.alloc.evacuate import evacuation_moves
from distpool.memory.alloc.move_cost import MoveCost
from distpool.memory.arena.band import Band
from tests.memory.band_factory import make_band

PAGE_BYTES = 1000
# A run costs a tenth of a page: moving a page to save a run never pays below the bound.
COST = MoveCost(page_bytes=PAGE_BYTES, run_bytes=100, max_runs=3, over_run_bytes=10 * PAGE_BYTES)


def _copy_in_order(contents: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    out = contents.copy()
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        out[d] = out[s]
    return out


def _plan(band: Band, pages: list[np.ndarray], *, bottom: int, window: int = 0, rooms=None):
    plan = evacuation_moves(
        band,
        np.zeros(band.num_positions, dtype=bool),
        np.zeros(band.num_positions + 1, dtype=np.int64),
        None,
        pages,
        rooms or [0] * len(pages),
        COST,
        bottom=bottom,
        window=window,
    )
    return None if plan is None else (plan.src, plan.dst)


def test_only_the_pages_in_the_way_move_when_that_costs_less_than_moving_the_request_whole():
    # A holds 6..11, B 4..5, C 18..19; positions below 8 must be freed (a new slot needs them).
    band, (a, b, c) = make_band(20, [list(range(6, 12)), [4, 5], [18, 19]])
    src, dst = _plan(band, [a, b, c], bottom=8)
    # A (largest first) moves its two pages in the way, not its six (one run more costs a tenth of
    # a page); B follows.
    assert src.tolist() == [6, 7, 4, 5]
    assert dst.tolist() == [12, 13, 14, 15]


def test_a_request_at_its_run_bound_moves_whole_and_a_later_one_takes_its_old_place():
    # A is in 3 runs (the bound): 5..7, 9, 11; D, E, F hold 8, 10, 12; C holds 3. Below 6 must
    # be freed. Moving only A's page 5 would split it into a fourth run (ten pages' price), so A
    # moves whole to 13..17 (one run); C then takes A's old 11, copied after A left.
    band, (a, c, d, e, f) = make_band(24, [[5, 6, 7, 9, 11], [3], [8], [10], [12]])
    src, dst = _plan(band, [a, c, d, e, f], bottom=6)
    assert src.tolist() == [5, 6, 7, 9, 11, 3]
    assert dst.tolist() == [13, 14, 15, 16, 17, 11]
    contents = np.arange(24) * 10
    moved = _copy_in_order(contents, src, dst)
    assert moved[13:18].tolist() == contents[a].tolist() and moved[11] == contents[3]
    reversed_order = _copy_in_order(contents, src[::-1], dst[::-1])
    assert reversed_order[13:18].tolist() != contents[a].tolist()  # the order matters


def test_the_plan_costs_the_bytes_it_copies_and_the_runs_it_adds():
    band, (a, b, c) = make_band(20, [list(range(6, 12)), [4, 5], [18, 19]])
    plan = evacuation_moves(
        band,
        np.zeros(20, dtype=bool),
        np.zeros(21, dtype=np.int64),
        None,
        [a, b, c],
        [0, 0, 0],
        COST,
        bottom=8,
        window=0,
    )
    # Four pages copied; A gains a run (6, 7 leave for 12, 13), B keeps its one.
    assert plan.cost_bytes == 4 * PAGE_BYTES + COST.run_bytes


def test_a_window_is_cleared_where_it_moves_least():
    # 0..3 free, A 4..5, B 6, free 7..9, C 10..13, D 14, free 15..19: a 5-page window fits at
    # 15..19 already (cost 0), so nothing moves.
    band, pages = make_band(20, [[4, 5], [6], [10, 11, 12, 13], [14]])
    src, dst = _plan(band, pages, bottom=0, window=5)
    assert src.size == 0 and dst.size == 0
    # A 6-page window: the cheapest is 14..19 (D only); D goes whole to the best-fitting hole,
    # 7..9, at its low end.
    src, dst = _plan(band, pages, bottom=0, window=6)
    assert src.tolist() == [14] and dst.tolist() == [7]


def test_no_plan_when_what_must_move_fits_nowhere():
    band, pages = make_band(8, [[2, 3, 4, 5, 6, 7]])  # bottom 4: its 2 pages in the way, no free position
    assert _plan(band, pages, bottom=4) is None
