"""Placement: which free positions a batch's new units take. Pure choice over the bands' free runs.

Two policies for full-attention pages (the high band):
- "extent" (default): each request's pages as one run of ascending positions where a free run holds
  them (best fit over the holes, else the top of the gap between the bands while that leaves
  `gap_keep` pages for low units, else the largest holes; see `FreeRuns.take_extent`), so an
  envelope is a few long byte runs. A request that says how far it will grow (its final length)
  gets that room left free right after its extent where it fits, and other extents stay out of
  that room while anything else holds them (the allocator's `claims`). Growth goes right after the
  request's last page when that position is free, the rest as one best-fit extent shared by the
  batch's growing requests (the first request takes its highest share).
- "first_fit" (the baseline): the highest free positions, one at a time, whatever the holes.
Low-band units (slots, sliding-window pages) always take the lowest free positions: a slot is one
unit, and keeping the low band packed keeps the frontier low.

Callers check that the counts fit (Frontier.fits) before placing: placement never fails.
Positions come out in token order, ascending within each request for "extent".
"""

from __future__ import annotations

import numpy as np

from distpool.memory.arena import NO_POSITIONS, Band
from distpool.memory.errors import PlacementUnknown

PLACEMENTS = ("extent", "first_fit")
# Extent placement leaves this many low units' worth of the gap between the bands free while holes
# can take a request instead: a gap squeezed shut by pages forces a compaction for the next slot. 8
# (a batch of new slots) brought the churn trace's compactions to within 3% of first fit's, where 0
# cost 19% more (scripts/bench_pool.py, section d).
GAP_KEEP_LOW_UNITS = 8


class Placement:
    """Chooses positions in `low_band` and `high_band` under the policy `mode`."""

    def __init__(self, low_band: Band, high_band: Band, *, mode: str, gap_keep: int = 0) -> None:
        if mode not in PLACEMENTS:
            raise PlacementUnknown(mode, PLACEMENTS)
        self.low_band, self.high_band = low_band, high_band
        self.mode = mode
        self.gap_keep = gap_keep  # pages of the gap an extent leaves for low units while holes fit

    def low_positions(self, count: int) -> np.ndarray:
        """The `count` lowest free low-band positions, ascending."""
        return self.low_band.runs.take_lowest(count)

    def page_positions(
        self, counts: list[int], floor: int, rooms: list[int] | None = None, claims: np.ndarray | None = None
    ) -> np.ndarray:
        """Positions at or above `floor` for requests needing `counts` pages: request by request,
        each request's in token order. `rooms[i]`: the pages request i expects to grow by, kept
        free after it where they can be; `claims`: the rooms of requests already placed."""
        runs = self.high_band.runs
        total = sum(counts)
        if total == 0:
            return NO_POSITIONS
        if self.mode == "first_fit":
            return _ascending_per_request(runs.take_highest(total, floor), counts)
        rooms = rooms or [0] * len(counts)
        pieces = [
            piece
            for n, room in zip(counts, rooms, strict=True)
            if n
            for piece in runs.take_extent(n, floor, self.gap_keep, room=room, claims=claims)
        ]
        runs.finish_batch()
        return _positions_of(pieces)

    def extent_pieces(
        self, counts: list[int], floor: int, rooms: list[int], claims: np.ndarray | None
    ) -> list[int]:
        """How many pieces (free runs) each request would take if `page_positions` placed the
        batch now (extent placement); nothing is taken."""
        runs = self.high_band.runs.copy()
        return [
            len(runs.take_extent(n, floor, self.gap_keep, room=room, claims=claims)) if n else 0
            for n, room in zip(counts, rooms, strict=True)
        ]

    def growth_positions(
        self,
        last: np.ndarray,
        counts: np.ndarray,
        floor: int,
        rooms: np.ndarray | None = None,
        claims: np.ndarray | None = None,
        total: int | None = None,
    ) -> np.ndarray:
        """New pages for requests whose last page sits at `last` (-1: none yet) and that need
        `counts` more (each >= 1): request by request, each request's in token order. A request
        that grows elsewhere alone keeps `rooms[i]` (its further expected growth) free after it.
        `total`: counts.sum(), when the caller has it."""
        runs = self.high_band.runs
        total = int(counts.sum()) if total is None else total
        if self.mode == "first_fit":
            positions = runs.take_highest(total, floor)
            # One page each (a decode step): each request's share is one position, nothing to flip.
            return positions if total == counts.size else _ascending_per_request(positions, counts)
        if total == counts.size and self._none_free_after(last):
            # A decode step among packed extents (the common case): no request grows in place, so
            # all take one extent, the first request its top; the same rule as below, vectorized.
            room = int(rooms[0]) if rooms is not None and total == 1 else 0
            extent = self._extent(total, floor, room, claims)
            runs.finish_batch()
            return extent[::-1]
        after = np.where(last >= 0, last + 1, runs.num_positions)  # a request with no page grows nowhere
        in_place = runs.take_after(after, counts)
        rest = counts - in_place
        rest_total = int(rest.sum())
        moving = np.flatnonzero(rest)
        room = int(rooms[moving[0]]) if rooms is not None and moving.size == 1 else 0
        extent = self._extent(rest_total, floor, room, claims) if rest_total else NO_POSITIONS
        runs.finish_batch()
        if total == counts.size:  # one page each (a decode step): the same rule, without the bookkeeping
            after[moving] = extent[::-1]
            return after
        # Request i takes its in-place pages after[i] ... then its share of the extent; the first
        # request takes the extent's highest share, as pages are handed out highest first. Output
        # slot j belongs to request owner[j], the offset[j]-th of its new pages (vectorized).
        owner = np.repeat(np.arange(counts.size), counts)
        offset = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        if not rest_total:
            return after[owner] + offset
        share_start = rest_total - np.cumsum(rest) - in_place
        from_extent = np.clip(share_start[owner] + offset, 0, rest_total - 1)
        return np.where(offset < in_place[owner], after[owner] + offset, extent[from_extent])

    def _none_free_after(self, last: np.ndarray) -> bool:
        """Whether no position right after a `last` page is free, so that growth in place
        (`FreeRuns.take_after`) would take nothing: three array operations instead of its lookups.
        Conservative where it does not matter: a request without pages (-1) looks at position 0,
        one whose last page is the band's top at that page itself (both grow nowhere in place)."""
        return bool(self.high_band.owned.take(last + 1, mode="clip").all())

    def _extent(self, count: int, floor: int, room: int, claims: np.ndarray | None) -> np.ndarray:
        """The positions of `FreeRuns.take_extent` (count >= 1), ascending."""
        return _positions_of(
            self.high_band.runs.take_extent(count, floor, self.gap_keep, room=room, claims=claims)
        )


def _ascending_per_request(positions: np.ndarray, counts: list[int] | np.ndarray) -> np.ndarray:
    """Positions handed out highest first, split by `counts` and flipped so each request's run up."""
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(counts)
    # Output slot j of the request whose share is [start, end) takes positions[start + end - 1 - j].
    return positions[np.repeat(2 * ends - counts - 1, counts) - np.arange(positions.size)]


def _positions_of(pieces: list[tuple[int, int]]) -> np.ndarray:
    """The positions of (start, length) pieces, piece by piece."""
    if len(pieces) == 1:  # most extents are one piece
        start, length = pieces[0]
        return np.arange(start, start + length, dtype=np.int64)
    return np.concatenate([np.arange(s, s + n) for s, n in pieces] + [NO_POSITIONS])
