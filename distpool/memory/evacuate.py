"""Targeted compaction: make what a refused call needs by moving only the requests in the way.

A full compaction slides every page of the band (band.py), which keeps each request's pages and
growth room together but copies most of the arena. A refused call needs much less: the positions
below `bottom` free (so the low band's new units fit under the lowest page) and, for a request
that would otherwise scatter, one free run of `window` pages. The plan:
- window: among the windows with the fewest pages and growth room in them (at most WINDOW_TRIES,
  not overlapping), the first whose requests in the way each fit whole in one free run elsewhere;
  failing that, the first where a request too large for any free run moves only its pages in the
  way, as one run;
- each request with a page in the cleared positions moves, largest first, whole into one free run
  (with its own growth room after it where that fits too: `FreeRuns.take_extent`), or only its
  pages in the way as one run when it does not fit whole; nothing ever scatters.
Bytes moved: the requests in the way, not the arena. The copies run in the plan's order (a
destination is free, or the source of an earlier copy). None: no such plan (a pinned page in the
way, or no free run for what must move); the caller falls back to a full compaction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distpool.memory.band import Band
from distpool.memory.free_runs import NO_POSITIONS, FreeRuns

WINDOW_TRIES = 8  # cheapest windows tried for one whose requests in the way each fit whole elsewhere


def evacuation_moves(
    band: Band,
    pinned: np.ndarray,
    claims: np.ndarray,
    room: np.ndarray | None,
    requests: Sequence[np.ndarray],
    rooms: Sequence[int],
    *,
    bottom: int,
    window: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """(src, dst) page moves that leave every position below `bottom` free and, if `window` > 0,
    a run of `window` free positions at or above it. requests[i]: request i's physical pages in
    token order; rooms[i]: its expected growth; claims / room: as in the allocator."""
    owned, n = band.owned, band.num_positions
    cleared = np.zeros(n, dtype=bool)
    cleared[: min(bottom, n)] = True
    if not window:
        return _evacuate(band, pinned, claims, requests, rooms, cleared, whole_only=False)
    if bottom + window > n:
        return None
    # Windows by cost: the pages and growth room in them (a pinned page rules a window out); the
    # cheapest first, the highest of equals. Windows that overlap a tried one are skipped.
    taken = owned if room is None else owned | room
    cost = np.concatenate([[0], np.cumsum(taken.astype(np.int64) + pinned * (n + 1))])
    in_window = cost[bottom + window :] - cost[bottom : n - window + 1]
    order = np.argsort(in_window[::-1], kind="stable")[: WINDOW_TRIES * 64]
    tried: list[int] = []
    for start in (bottom + in_window.size - 1 - order).tolist():
        if len(tried) == WINDOW_TRIES or in_window[start - bottom] > n:
            break
        if any(abs(start - other) < window for other in tried):
            continue
        tried.append(start)
        mask = cleared.copy()
        mask[start : start + window] = True
        moves = _evacuate(band, pinned, claims, requests, rooms, mask, whole_only=True)
        if moves is not None:
            return moves
    for start in tried:  # then letting a request too large to go whole leave only its pages in the way
        mask = cleared.copy()
        mask[start : start + window] = True
        moves = _evacuate(band, pinned, claims, requests, rooms, mask, whole_only=False)
        if moves is not None:
            return moves
    return None


def _evacuate(
    band: Band,
    pinned: np.ndarray,
    claims: np.ndarray,
    requests: Sequence[np.ndarray],
    rooms: Sequence[int],
    cleared: np.ndarray,
    *,
    whole_only: bool,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Moves of the requests with a page in `cleared` into free positions outside it, largest
    first: each whole into one free run where one holds it (the positions it leaves outside
    `cleared` are free for the movers after it, whose copies come later), else (unless
    whole_only) only its pages in `cleared`. Rows in copy order: a destination is free or was
    the source of an earlier row. None when a pinned page is in the way or the free positions run
    out (or, whole_only, one would not go whole)."""
    if (cleared & pinned).any():
        return None
    occupants = [
        (pages, r) for pages, r in zip(requests, rooms, strict=True) if pages.size and cleared[pages].any()
    ]
    if not occupants:
        return NO_POSITIONS, NO_POSITIONS
    own_claims = claims.copy()
    own_claims[np.array([pages[-1] + 1 for pages, _ in occupants])] = 0  # their rooms move with them
    runs = FreeRuns.from_owned(band.owned | cleared)
    src, dst = [], []
    occupants.sort(key=lambda o: -o[0].size)
    for pages, request_room in occupants:
        left = NO_POSITIONS
        if runs.largest() >= pages.size:
            left = pages[~cleared[pages]]
        elif whole_only:
            return None
        else:
            pages, request_room = pages[cleared[pages]], 0  # its other pages stay where they are
            if runs.largest() < pages.size:
                return None  # they would scatter: a full compaction keeps every request together
        pieces = runs.take_extent(pages.size, 0, room=request_room, claims=own_claims)
        runs.finish_batch()
        runs.give(left)
        src.append(pages)
        dst.append(np.concatenate([np.arange(s, s + k) for s, k in pieces]))
    return np.concatenate(src), np.concatenate(dst)
