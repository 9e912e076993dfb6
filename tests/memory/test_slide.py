"""Partial slides (slide.py): the cheapest stretch to slide up for a free run, and its moves."""

from __future__ import annotations

import numpy as np

from distpool.memory.alloc.slide import cheapest_slide, slide_moves
from tests.memory.band_factory import make_band


def test_the_cheapest_stretch_slides_up_in_order_and_no_holder_gains_a_run():
    # [a a . b . . c c . d]: four free pages, none of them adjacent to three others.
    band, pages = make_band(10, [[0, 1], [3], [6, 7], [9]])
    nothing_pinned = np.zeros(10, dtype=bool)
    slide = cheapest_slide(band, nothing_pinned, None, pages, bottom=0, window=4)
    # From 2 (a's pages end at 1, so a stretch from 1 would split a): b, c, c move up.
    assert (slide.start, slide.end, slide.pages_moved) == (2, 9, 3)
    src, dst = slide_moves(band, nothing_pinned, None, slide)
    assert src.tolist() == [3, 6, 7] and dst.tolist() == [6, 7, 8]
    # Copied one at a time, highest source first, no page overwrites one still to be copied.
    contents = np.arange(10) * 10
    for s, d in zip(src[::-1].tolist(), dst[::-1].tolist(), strict=True):
        contents[d] = contents[s]
    assert contents[6:10].tolist() == [30, 60, 70, 90]


def test_a_pinned_page_rules_out_every_stretch_over_it():
    band, pages = make_band(10, [[0, 1], [3], [6, 7], [9]])
    pinned = np.zeros(10, dtype=bool)
    pinned[3] = True
    # Above 3 only 4, 5 and 8 are free: no stretch without b holds four.
    assert cheapest_slide(band, pinned, None, pages, bottom=0, window=4) is None
    assert cheapest_slide(band, pinned, None, pages, bottom=0, window=3).start == 4


def test_pages_below_the_bottom_slide_from_the_lowest_page():
    band, pages = make_band(10, [[2, 3], [6]])
    slide = cheapest_slide(band, np.zeros(10, dtype=bool), None, pages, bottom=4, window=0)
    # Positions below 4 must be free: the stretch starts at the lowest page and holds 2 free.
    assert (slide.start, slide.end, slide.pages_moved) == (2, 6, 2)
    src, dst = slide_moves(band, np.zeros(10, dtype=bool), None, slide)
    assert src.tolist() == [2, 3] and dst.tolist() == [4, 5]
