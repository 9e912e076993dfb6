"""Growth claims: where each live request expects to grow, kept free for it while anything else fits.

A request that says how long it will get (its final length at reserve) has `RequestTable.room`
pages of growth still to come. The claim sits at the page position right after the request's last
page: `by_position[p]` is the room of the request whose last page is at p - 1 (0 elsewhere;
position 0 never holds a claim, since no page ends before it). Placement leaves the free part of a
claim alone while anything else fits (`FreeRuns.take_extent`); a compaction that keeps room treats
it as a placeholder after its request (`room_mask`).

    positions   10 11 12 13 14 15 16
    request a   [a  a  a]                 room 2   ->  by_position[13] = 2
    free                  .  .  .  .      a grows into 13, 14 first
"""

from __future__ import annotations

import numpy as np

from distpool.memory.alloc.requests import RequestTable
from distpool.memory.arena import Band, require


class GrowthClaims:
    """The growth room of `table`'s requests, indexed by page position in `band` (the high band)."""

    def __init__(self, band: Band, table: RequestTable) -> None:
        self.band, self.table = band, table
        self.by_position = np.zeros(band.num_positions + 1, dtype=np.int64)

    def live(self) -> np.ndarray | None:
        """The claims, or None while no request expects to grow (placement skips the lookups)."""
        return self.by_position if self.table.room.any() else None

    def ends(self, rows: np.ndarray) -> np.ndarray:
        """Position after each row's last page (0 for a row without pages: no page ends there)."""
        vlast = self.table.last_vpage[rows]
        ends = np.zeros(vlast.shape, dtype=np.int64)
        paged = vlast >= 0  # never index the page band for a row without pages: it may have none
        ends[paged] = self.band.physical(vlast[paged]) + 1
        return ends

    def set(self, rows: np.ndarray) -> None:
        """Claim each row's room right after its last page (as the table says now)."""
        ends = self.ends(rows)
        self.by_position[ends] = np.where(ends > 0, self.table.room[rows], 0)

    def clear(self, rows: np.ndarray) -> None:
        self.by_position[self.ends(rows)] = 0

    def take_room(self, rows: np.ndarray, last: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
        """Rows whose last pages sit at `last` (-1: none) grow by `counts` pages: their claims leave
        the old ends and their room shrinks by what they take. Returns the room each keeps, to be
        claimed again with `set` once the pages are placed; None when no row had room (nothing
        changes)."""
        table = self.table
        if self.live() is None or not table.room[rows].any():
            return None
        self.by_position[last + 1] = 0  # the old ends (-1 + 1 = 0: none, position 0 holds no claim)
        rooms = np.maximum(table.room[rows] - counts, 0)
        table.room[rows] = rooms
        return rooms

    def reset(self) -> None:
        """Claims of every live request from scratch (after a compaction moved their pages)."""
        self.by_position[:] = 0
        self.set(self.table.live_rows())

    def room_mask(self) -> np.ndarray | None:
        """Free positions that are growth room: the first claims[s] positions of each free run
        starting at s. None when no run holds a claim."""
        runs = self.band.runs
        claimed = np.minimum(self.by_position[runs.starts], runs.ends - runs.starts)
        has = np.flatnonzero(claimed > 0)
        if not has.size:
            return None
        edges = np.zeros(self.band.num_positions + 1, dtype=np.int64)
        np.add.at(edges, runs.starts[has], 1)
        np.add.at(edges, runs.starts[has] + claimed[has], -1)
        return np.cumsum(edges[:-1]) > 0

    def check(self) -> None:
        live = self.table.live_rows()
        ends = self.ends(live)
        expected = np.zeros_like(self.by_position)
        expected[ends] = np.where(ends > 0, self.table.room[live], 0)
        require(
            np.array_equal(expected, self.by_position),
            "claims-placed",
            "growth claims sit right after their requests' last pages",
        )
