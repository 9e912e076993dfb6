"""A slide over part of the high band: the pages of one stretch of positions move up, in order, to
the stretch's top, so its free positions gather at its bottom as one run.

A full compaction slides the whole band. A refused call needs one free run of `window` pages (and
every position below `bottom` free); the cheapest stretch that holds that many free positions is
usually a small part of the band. Pages keep their order, so no request gains a byte run (pieces
of a request inside the stretch may join), except one that crosses the stretch's lower edge:
stretches start only where no request continues across (a free position below, or another
holder's page, or a page that is not the next of the same request).

    before    [ a a . b . . c c . d ]       stretch [2, 9), window 4
    after     [ a a . . . . b c c d ]       b and c moved up: 3 pages copied, runs unchanged
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distpool.memory.arena import Band


@dataclass(frozen=True)
class Slide:
    """The stretch [start, end) to slide and the pages it moves."""

    start: int
    end: int
    pages_moved: int


def cheapest_slide(
    band: Band,
    pinned: np.ndarray,
    room: np.ndarray | None,
    holders: Sequence[np.ndarray],
    *,
    bottom: int,
    window: int,
) -> Slide | None:
    """The stretch whose slide leaves positions [0, bottom) free and a free run of `window` pages at
    or above `bottom`, moving the fewest pages; None when no stretch does (pinned pages in every
    candidate, or too few free positions). `room`: free positions that are growth room (they
    travel with their request, so they are not gathered); holders[i]: a holder's physical pages in
    token order."""
    n = band.num_positions
    owned = band.owned
    gathered = ~owned if room is None else ~owned & ~room
    free_before = np.concatenate([[0], np.cumsum(gathered)])
    pinned_before = np.concatenate([[0], np.cumsum(pinned)])
    lowest = band.lowest_owned()
    if lowest is not None and lowest < bottom:
        # Pages below `bottom` must go: the stretch starts at the lowest page (all below is free).
        starts = np.array([lowest], dtype=np.int64)
        needed = bottom - lowest + window
    else:
        starts = np.arange(bottom, n, dtype=np.int64)
        needed = window
        continues = np.zeros(n + 1, dtype=bool)  # position p holds the next page of p - 1's request
        for pages in holders:
            if pages.size > 1:
                continues[pages[1:][np.diff(pages) == 1]] = True
        starts = starts[~continues[starts]]
    if not needed or not starts.size:
        return None
    ends = np.searchsorted(free_before, free_before[starts] + needed, side="left")
    fits = ends <= n
    starts, ends = starts[fits], ends[fits]
    if not starts.size:
        return None
    clear = pinned_before[ends] == pinned_before[starts]
    moved = (ends - starts) - (free_before[ends] - free_before[starts])  # units moving up
    if room is not None:
        room_before = np.concatenate([[0], np.cumsum(room & ~owned)])
        moved -= room_before[ends] - room_before[starts]  # placeholders: no bytes
    moved = np.where(clear, moved, np.iinfo(np.int64).max)
    best = int(np.argmin(moved))
    if not clear[best]:
        return None
    return Slide(start=int(starts[best]), end=int(ends[best]), pages_moved=int(moved[best]))


def slide_moves(
    band: Band, pinned: np.ndarray, room: np.ndarray | None, slide: Slide
) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of `slide`: the band's own slide with every position outside the stretch held."""
    outside = np.ones(band.num_positions, dtype=bool)
    outside[slide.start : slide.end] = False
    return band.compaction_moves(pinned | outside, None if room is None else room & ~outside, slide=True)
