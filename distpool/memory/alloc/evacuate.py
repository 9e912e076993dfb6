"""Targeted compaction: make what a refused or scattering call needs by moving only what is in the way.

A full compaction slides every page of the band (band.py), which keeps each request's pages and
growth room together but copies most of the arena. A call needs much less: the positions below
`bottom` free (so the low band's new units fit under the lowest page) and, for a request that would
otherwise scatter, one free run of `window` pages. The plan (`Evacuation`):
- each holder with a page in the cleared positions moves, largest first, in the cheaper of two ways
  under the cost model (move_cost.py): whole (with its growth room after it where that fits too:
  `FreeRuns.take_extent`), which also joins the runs it was split in; or only its pages in the
  way, leaving the rest where it is. Either way its pages go to the fewest free runs outside the
  cleared positions; a plan may scatter a holder when nothing cheaper exists, and the runs that adds
  are in its cost;
- window: the one asked for (`window_at`: right after a growing request), or among the windows
  with the fewest pages and growth room in them (at most WINDOW_TRIES, not overlapping, no pinned
  page) the one whose evacuation costs least.
The copies run in the plan's order: a destination is free, or the source of an earlier copy. None:
no plan (a pinned page in the way, or too few free positions outside the cleared ones); the planner
then slides (slide.py) or falls back to a full compaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distpool.memory.alloc.move_cost import MoveCost
from distpool.memory.arena import NO_POSITIONS, Band, FreeRuns, num_runs

WINDOW_TRIES = 8  # cheapest windows (by pages in them) whose evacuations are planned and compared


@dataclass(frozen=True)
class Evacuation:
    """Page moves and their cost (`MoveCost.of`, bytes of copying). The copies run in the order
    given, or highest source first for a slide (`slide`: every page moves up, slide.py)."""

    src: np.ndarray  # physical positions, int64
    dst: np.ndarray
    cost_bytes: float
    slide: bool = False


def evacuation_moves(
    band: Band,
    pinned: np.ndarray,
    claims: np.ndarray,
    room: np.ndarray | None,
    holders: Sequence[np.ndarray],
    rooms: Sequence[int],
    cost: MoveCost,
    *,
    bottom: int,
    window: int,
    window_at: int = -1,
) -> Evacuation | None:
    """The cheapest plan found that leaves every position below `bottom` free and, if `window` > 0,
    a run of `window` free positions at or above it (starting at `window_at` when >= 0).
    holders[i]: holder i's physical pages in token order; rooms[i]: its expected growth; claims /
    room: the growth claims and the free positions they cover (claims.py)."""
    n = band.num_positions
    cleared = np.zeros(n, dtype=bool)
    cleared[: min(bottom, n)] = True
    if not window:
        return _evacuate(band, pinned, claims, holders, rooms, cleared, cost)
    if bottom + window > n:
        return None
    if window_at >= 0:
        cleared[window_at : window_at + window] = True
        return _evacuate(band, pinned, claims, holders, rooms, cleared, cost)
    # Windows by the pages and growth room in them (a pinned page rules a window out); the
    # cheapest first, the highest of equals. Windows that overlap a tried one are skipped.
    taken = band.owned if room is None else band.owned | room
    taken_before = np.concatenate([[0], np.cumsum(taken.astype(np.int64) + pinned * (n + 1))])
    in_window = taken_before[bottom + window :] - taken_before[bottom : n - window + 1]
    order = np.argsort(in_window[::-1], kind="stable")[: WINDOW_TRIES * 64]
    tried: list[int] = []
    best: Evacuation | None = None
    for start in (bottom + in_window.size - 1 - order).tolist():
        if len(tried) == WINDOW_TRIES or in_window[start - bottom] > n:
            break
        if any(abs(start - other) < window for other in tried):
            continue
        tried.append(start)
        mask = cleared.copy()
        mask[start : start + window] = True
        plan = _evacuate(band, pinned, claims, holders, rooms, mask, cost)
        if plan is not None and (best is None or plan.cost_bytes < best.cost_bytes):
            best = plan
    return best


def _evacuate(
    band: Band,
    pinned: np.ndarray,
    claims: np.ndarray,
    holders: Sequence[np.ndarray],
    rooms: Sequence[int],
    cleared: np.ndarray,
    cost: MoveCost,
) -> Evacuation | None:
    """Moves of the holders with a page in `cleared` into free positions outside it, largest first,
    each whole or only its pages in `cleared`, whichever costs less. The positions a mover leaves
    outside `cleared` are free for the movers after it, whose copies come later. None when a pinned
    page is in the way or the free positions run out."""
    if (cleared & pinned).any():
        return None
    occupants = [
        (pages, r) for pages, r in zip(holders, rooms, strict=True) if pages.size and cleared[pages].any()
    ]
    if not occupants:
        return Evacuation(src=NO_POSITIONS, dst=NO_POSITIONS, cost_bytes=0.0)
    own_claims = claims.copy()
    own_claims[np.array([pages[-1] + 1 for pages, _ in occupants])] = 0  # their rooms move with them
    runs = FreeRuns.from_owned(band.owned | cleared)
    src, dst, total = [], [], 0.0
    occupants.sort(key=lambda o: -o[0].size)
    for pages, request_room in occupants:
        in_way = cleared[pages]
        best = None
        for moving, keep_room in ((pages, request_room), (pages[in_way], 0)):
            if runs.num_free < moving.size or (best is not None and moving.size == pages.size):
                continue
            after = runs.copy()
            to = _place(after, moving.size, keep_room, own_claims)
            placed = pages.copy()
            placed[np.isin(pages, moving)] = to  # `moving` is in token order, and so is `to`
            price = cost.of(moving.size, num_runs(pages), num_runs(placed))
            if best is None or price < best[0]:
                best = (price, after, moving, to)
        if best is None:
            return None
        price, runs, moving, to = best
        runs.give(moving[~cleared[moving]])  # what it leaves outside the cleared positions
        src.append(moving)
        dst.append(to)
        total += price
    return Evacuation(src=np.concatenate(src), dst=np.concatenate(dst), cost_bytes=total)


def _place(runs: FreeRuns, count: int, room: int, claims: np.ndarray) -> np.ndarray:
    """`count` positions taken from `runs` by `FreeRuns.take_extent`, ascending piece by piece."""
    pieces = runs.take_extent(count, 0, room=room, claims=claims)
    runs.finish_batch()
    return np.concatenate([np.arange(s, s + k, dtype=np.int64) for s, k in pieces] + [NO_POSITIONS])
