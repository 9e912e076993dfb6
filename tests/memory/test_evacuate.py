"""Targeted compaction plans (evacuate.py): who moves, where to, and in which order the copies run."""

from __future__ import annotations

import numpy as np

from distpool.memory.band import Band
from distpool.memory.evacuate import evacuation_moves
from distpool.memory.free_runs import FreeRuns


def _band(size: int, requests: list[list[int]]) -> tuple[Band, list[np.ndarray]]:
    """A high band whose request i owns `requests[i]` (positions in token order)."""
    band = Band(size, grows_up=False)
    pages = [np.array(positions, dtype=np.int64) for positions in requests]
    for physical in pages:
        band.assign(physical)
    band.runs = FreeRuns.from_owned(band.owned)
    return band, pages


def _copy_in_order(contents: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    out = contents.copy()
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        out[d] = out[s]
    return out


def _plan(band: Band, pages: list[np.ndarray], *, bottom: int, window: int = 0, rooms=None):
    return evacuation_moves(
        band,
        np.zeros(band.num_positions, dtype=bool),
        np.zeros(band.num_positions + 1, dtype=np.int64),
        None,
        pages,
        rooms or [0] * len(pages),
        bottom=bottom,
        window=window,
    )


def test_the_requests_in_the_way_move_whole_and_a_later_one_may_take_an_earlier_ones_old_place():
    # A holds 6..11, B 4..5, C 18..19; positions below 8 must be freed (a new slot needs them).
    band, (a, b, c) = _band(20, [list(range(6, 12)), [4, 5], [18, 19]])
    src, dst = _plan(band, [a, b, c], bottom=8)
    # A (largest first) goes whole to [12, 18); then B takes A's old 8, 9, copied after A left.
    assert src.tolist() == [6, 7, 8, 9, 10, 11, 4, 5]
    assert dst.tolist() == [12, 13, 14, 15, 16, 17, 8, 9]
    contents = np.arange(20) * 10
    moved = _copy_in_order(contents, src, dst)
    assert moved[12:18].tolist() == contents[6:12].tolist() and moved[8:10].tolist() == contents[4:6].tolist()
    reversed_order = _copy_in_order(contents, src[::-1], dst[::-1])
    assert reversed_order[12:18].tolist() != contents[6:12].tolist()  # the order matters


def test_a_request_too_large_to_move_whole_moves_only_its_pages_in_the_way():
    band, (a, c) = _band(20, [list(range(6, 14)), [17, 18, 19]])  # free outside: [14, 17) only
    src, dst = _plan(band, [a, c], bottom=8)
    assert src.tolist() == [6, 7] and dst.tolist() == [14, 15]


def test_a_window_is_cleared_where_it_moves_least_and_nothing_scatters():
    # 0..3 free, A 4..5, B 6, free 7..9, C 10..13, D 14, free 15..19: a 5-page window fits at
    # 15..19 already (cost 0), so nothing moves.
    band, pages = _band(20, [[4, 5], [6], [10, 11, 12, 13], [14]])
    src, dst = _plan(band, pages, bottom=0, window=5)
    assert src.size == 0 and dst.size == 0
    # A 6-page window: the cheapest is 14..19 (D only); D goes whole to the best-fitting hole,
    # 7..9, at its low end.
    src, dst = _plan(band, pages, bottom=0, window=6)
    assert src.tolist() == [14] and dst.tolist() == [7]


def test_no_plan_when_what_must_move_fits_nowhere():
    band, pages = _band(8, [[2, 3, 4, 5, 6, 7]])  # bottom 4: its 2 pages in the way, no free run
    assert _plan(band, pages, bottom=4) is None
