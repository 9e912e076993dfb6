"""The compaction planner: which units move where when a unified arena compacts. Plans are pure;
`ArenaPool.compact` copies the bytes, then the allocator applies the plan to its maps.

- For a refusal's needs (`NeedsCompaction`: low units, a run of pages for a request that would
  scatter), only the requests in the way move (evacuate.py), when that is possible;
- otherwise a full compaction: the low band packs down, full pages slide up keeping each request's
  pages together (extent placement) or fill holes unit by unit (the first-fit baseline).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distpool.memory.arena import BandGeometry
from distpool.memory.band import Band
from distpool.memory.claims import GrowthClaims
from distpool.memory.evacuate import evacuation_moves
from distpool.memory.free_runs import FreeRuns
from distpool.memory.frontier import CompactionMoves, Frontier
from distpool.memory.layout import ceil_div
from distpool.memory.pool import DoesNotFit, NeedsCompaction
from distpool.memory.requests import RequestTable
from distpool.memory.sharing import SharedPages


class CompactionPlanner:
    """Plans compactions of the bands behind `frontier` around `table`'s pinned requests.

    `extent`: whether pages are placed as extents (plans keep requests together and may move only
    what is in the way) or first fit (the baseline's unit-by-unit fill)."""

    def __init__(
        self,
        frontier: Frontier,
        table: RequestTable,
        claims: GrowthClaims,
        sharing: SharedPages,
        *,
        extent: bool,
    ) -> None:
        self.frontier, self.table, self.claims, self.sharing = frontier, table, claims, sharing
        self.extent = extent

    @property
    def low(self) -> BandGeometry | None:
        return self.frontier.low

    @property
    def high(self) -> BandGeometry | None:
        return self.frontier.high

    @property
    def low_band(self) -> Band:
        return self.frontier.low_band

    @property
    def high_band(self) -> Band:
        return self.frontier.high_band

    # ---- when to compact -----------------------------------------------------------------------
    def runs_after_compaction(self) -> tuple[FreeRuns | None, FreeRuns | None]:
        """Free runs as they would be after a full compaction (None, None: as they are)."""
        if not self.frontier.unified:
            return None, None
        return self.frontier.runs_after(self.compaction_moves(keep_room=False))

    def refusal(
        self, request_ids: Sequence[str], low_count: int, high_count: int, whole: int = 0
    ) -> DoesNotFit:
        """The refusal: NeedsCompaction when a full compaction makes room (`whole`: the pages the
        largest request wants in one run, asked of the compaction when no free run holds them)."""
        low_now, high_now = self.frontier.available()
        low_name = self.low.name if self.low else "slots"
        reason = (
            f"{len(request_ids)} request(s) need {low_count} {low_name} and {high_count} pages; available "
            f"now: {low_now} {low_name}, {high_now} pages"
        )
        if self.frontier.unified and self.frontier.fits(low_count, high_count, *self.runs_after_compaction()):
            window = whole if self.high_band.runs.largest(self.frontier.high_floor()) < whole else 0
            return NeedsCompaction(
                request_ids[0],
                reason + "; compaction would make room: call compact()",
                low=low_count,
                window=window,
            )
        pinned = len(self.table.pinned_rows())
        return DoesNotFit(request_ids[0], reason + f" ({len(self.table)} live requests, {pinned} pinned)")

    def gathers_whole(self, high_counts: list[int]) -> bool:
        """Whether the largest of `high_counts` would scatter over several free runs now, and a
        compaction would gather the pages free outside other requests' growth room to hold the batch."""
        if not self.frontier.unified or not self.extent or not high_counts or not max(high_counts):
            return False
        if self.high_band.runs.largest(self.frontier.high_floor()) >= max(high_counts):
            return False
        return self.frontier.available()[1] >= sum(high_counts)

    # ---- plans ---------------------------------------------------------------------------------
    def compaction_moves(
        self, *, keep_room: bool = False, need: NeedsCompaction | None = None
    ) -> CompactionMoves:
        """Moves that pack both bands around pinned requests (none for a static pool). Pure.

        keep_room: the free part of each request's growth claim stays right after its last page.
        Without it (the default) this is the full compaction a `NeedsCompaction` promises room
        after: growth room is a hint, and kept room could leave a promised request short.
        need: what a refused call lacked (low units, and a run of pages for a request that would
        scatter): only the requests in the way move (evacuate.py), when that is possible."""
        low_pinned, high_pinned = self._pinned_masks()
        room = self.claims.room_mask() if keep_room else None
        if need is not None and self.extent:
            evacuation = self._evacuation(need, low_pinned, high_pinned, room)
            if evacuation is not None:
                return self.frontier.compaction_moves(low_pinned, high_pinned, evacuation, high_slide=False)
        # First fit keeps the baseline's unit-by-unit fill.
        high_moves = self.high_band.compaction_moves(high_pinned, room, slide=self.extent)
        return self.frontier.compaction_moves(low_pinned, high_pinned, high_moves, high_slide=self.extent)

    def _pinned_masks(self) -> tuple[np.ndarray, np.ndarray]:
        low = np.zeros_like(self.low_band.owned)
        high = np.zeros_like(self.high_band.owned)
        table = self.table
        for r in table.pinned_rows():  # a loop over pinned requests, not positions
            vlow = [table.vslot[r]] if table.vslot[r] >= 0 else []
            low[self.low_band.physical(np.array(vlow + table.vswa[r], dtype=np.int64))] = True
            high[self.high_band.physical(np.array(table.vpages[r], dtype=np.int64))] = True
        return low, high

    def _bottom(self, new_low: int, low_pinned: np.ndarray) -> int:
        """The page position that the low band, packed down, reaches with `new_low` more units."""
        if self.low is None or self.high is None:
            return 0
        pinned_top = int(np.flatnonzero(low_pinned)[-1]) if low_pinned.any() else -1
        top = max(self.low_band.num_owned + new_low - 1, pinned_top)
        end = self.low.base_bytes + (top + 1) * self.low.stride_bytes
        return max(0, ceil_div(end - self.high.base_bytes, self.high.stride_bytes))

    def _evacuation(
        self, need: NeedsCompaction, low_pinned: np.ndarray, high_pinned: np.ndarray, room: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Page moves that make room for `need` once the low band is packed down, or None."""
        if self.high is None:
            return None
        bottom = self._bottom(need.low, low_pinned)
        pages, rooms = self.sharing.holder_groups(self.table.live_rows())
        return evacuation_moves(
            self.high_band,
            high_pinned,
            self.claims.by_position,
            room,
            pages,
            rooms,
            bottom=bottom,
            window=need.window,
        )
