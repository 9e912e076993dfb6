"""Growth of live requests: the work of `Allocator.extend_batch`.

A request grows by tokens; it takes pages only when the new tokens cross a page boundary, and (hybrid
SWA) its window slides: window pages every token of which left the window go back to the low band,
new ones come from it. A decode step extends every running request by one token, and most cross no
boundary: those cost a few array operations for the whole batch and touch no band. Requests that do
take pages go through the frontier (does it fit), the planner (would clearing a run pay) and the
placement (which positions), as a reserve does; their growth room shrinks by what they take.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distpool.memory.alloc.claims import GrowthClaims
from distpool.memory.alloc.compaction import CompactionPlanner
from distpool.memory.alloc.footprint import Footprint
from distpool.memory.alloc.placement import Placement
from distpool.memory.alloc.requests import RequestTable, concat_ids
from distpool.memory.arena import NO_POSITIONS, Frontier
from distpool.memory.errors import NeedsCompaction


class Growth:
    """Grows `table`'s requests over the bands behind `frontier`; shares the allocator's parts."""

    def __init__(
        self,
        footprint: Footprint,
        table: RequestTable,
        frontier: Frontier,
        placement: Placement,
        claims: GrowthClaims,
        planner: CompactionPlanner,
    ) -> None:
        self.footprint, self.table = footprint, table
        self.frontier, self.placement, self.claims, self.planner = frontier, placement, claims, planner
        self.low_band, self.high_band = frontier.low_band, frontier.high_band

    def extend_batch(self, requests: Sequence[tuple[str, int]], *, prefer_compaction: bool = False) -> None:
        """`Allocator.extend_batch`: grow each (request_id, num_new_tokens), all or nothing."""
        table = self.table
        ids, added, rows = table.checked_rows(requests, "extend")
        if not ids:
            return
        old = table.num_tokens[rows]
        new = old + added
        if not self.footprint.has_swa:
            if self.footprint.has_pages:
                # -old % page_size: free tokens in the last page (0: full or none). Where the added
                # tokens exceed them by `short` > 0, the request takes ceil(short / page_size) pages.
                page_size = self.footprint.page_size
                short = added - -old % page_size
                if np.maximum.reduce(short) > 0:  # one reduction on the common step that takes no page
                    growing = (short > 0).nonzero()[0]
                    some = slice(None) if growing.size == rows.size else growing  # all: views, no gathers
                    self._grow(
                        ids, rows[some], -(-short[some] // page_size), prefer_compaction=prefer_compaction
                    )
            table.num_tokens[rows] = new
            return
        new_pages, new_swa, drops = self.footprint.growth_array(old, new)
        changing = np.flatnonzero(new_pages | new_swa | drops)
        if changing.size:
            dropped = concat_ids(
                [table.vswa[r][:d] for r, d in zip(rows[changing], drops[changing], strict=True)]
            )
            self._grow(
                ids,
                rows[changing],
                new_pages[changing],
                new_swa[changing],
                dropped,
                drops[changing],
                prefer_compaction=prefer_compaction,
            )
        table.num_tokens[rows] = new

    def _grow(
        self,
        ids: Sequence[str],
        rows: np.ndarray,
        new_pages: np.ndarray,
        new_swa: np.ndarray | None = None,
        dropped_swa: np.ndarray = NO_POSITIONS,
        drops: np.ndarray | None = None,
        *,
        prefer_compaction: bool = False,
    ) -> None:
        """Give `rows` their new pages (and window pages), freeing `dropped_swa`; all or nothing.
        Without a window (`new_swa` None) every row takes pages: `new_pages` >= 1 each."""
        table = self.table
        num_pages = int(new_pages.sum())
        num_swa = int(new_swa.sum()) if new_swa is not None else 0
        low_runs = None
        if dropped_swa.size:  # fit as if the dropped window pages were already free
            low_runs = self.low_band.runs.copy()
            low_runs.give(self.low_band.physical(dropped_swa))
        if not self.frontier.fits(num_swa, num_pages, low_runs):
            raise self.planner.refusal(ids, num_swa, num_pages)
        # A batch taking one page each (a decode step) adds a run at most to each: not worth a look.
        if prefer_compaction and (num_pages > rows.size or rows.size == 1):
            paging = np.flatnonzero(new_pages) if new_swa is not None else slice(None)
            window = self.planner.growth_window(rows[paging], new_pages[paging], low_runs)
            if window is not None:
                raise NeedsCompaction(
                    ids[0],
                    "its growth would add runs that clearing free pages for it saves",
                    low=num_swa,
                    pages=num_pages,
                    window=window[0],
                    window_at=window[1],
                )
        floor, swa_v = self.frontier.high_floor(), NO_POSITIONS
        if num_swa or dropped_swa.size:
            self.low_band.free(dropped_swa)
            swa_pos = self.placement.low_positions(num_swa)
            floor = self.frontier.high_floor(extra_low_top=int(swa_pos[-1]) if swa_pos.size else -1)
            swa_v = self.low_band.assign(swa_pos)
        if num_pages:
            paging = np.flatnonzero(new_pages) if new_swa is not None else slice(None)
            rows_paging, counts = rows[paging], new_pages[paging]
            vlast = table.last_vpage[rows_paging]
            last = self.high_band.physical(vlast)
            last[vlast < 0] = -1  # no page yet (v2p[-1] above is meaningless)
            rooms = self.claims.take_room(rows_paging, last, counts)
            positions = self.placement.growth_positions(
                last, counts, floor, rooms, self.claims.live(), num_pages
            )
            table.append_pages(rows_paging, counts, self.high_band.assign(positions))
            if rooms is not None:
                self.claims.set(rows_paging)
        if new_swa is not None:
            table.slide_windows(rows, drops, new_swa, swa_v)
