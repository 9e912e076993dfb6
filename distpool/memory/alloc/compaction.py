"""The compaction planner: which units move where, and when moving pays. Plans are pure;
`ArenaPool.compact` copies the bytes, then the allocator applies the plan to its maps.

What a plan is for (`NeedsCompaction` says which):
- room a refused call lacks (pages below the low band's new units, or pages the call needs);
- a free run for a new request that would otherwise scatter (`window`), asked for by the reserve
  only when clearing it costs less than the runs the scatter adds (`window_pays`);
- a free run for a request's growth (`growth_window`), anywhere or right after its last page
  (`window_at`), when that costs less than the runs its growth would add.
Each is met by the cheaper of two plans under the cost model (move_cost.py): the holders in the way
move (evacuate.py), or the stretch of the band that holds enough free pages slides up (slide.py).
The low band stays as it is unless the pages fit only once it packs down. When neither plan
serves, a full compaction packs the low band down and slides every page up, keeping each request's
pages together (extent placement) or filling holes unit by unit (the first-fit baseline).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distpool.memory.alloc.claims import GrowthClaims
from distpool.memory.alloc.evacuate import Evacuation, evacuation_moves
from distpool.memory.alloc.move_cost import MoveCost
from distpool.memory.alloc.placement import Placement
from distpool.memory.alloc.requests import RequestTable
from distpool.memory.alloc.sharing import SharedPages
from distpool.memory.alloc.slide import cheapest_slide, slide_moves
from distpool.memory.arena import CompactionMoves, FreeRuns, Frontier, lowest_free_top, num_runs
from distpool.memory.errors import DoesNotFit, NeedsCompaction
from distpool.memory.sizing import ceil_div


class CompactionPlanner:
    """Plans compactions of the bands behind `frontier` around `table`'s pinned requests, and
    decides when a move pays under `cost`. With first-fit `placement` it plans only the baseline's
    full compactions."""

    def __init__(
        self,
        frontier: Frontier,
        placement: Placement,
        table: RequestTable,
        claims: GrowthClaims,
        sharing: SharedPages,
        cost: MoveCost,
    ) -> None:
        self.frontier, self.placement, self.table = frontier, placement, table
        self.claims, self.sharing, self.cost = claims, sharing, cost
        self.low_band, self.high_band = frontier.low_band, frontier.high_band
        self.targeted = frontier.unified and placement.mode == "extent" and frontier.high is not None

    # ---- refusals -------------------------------------------------------------------------------
    def runs_after_compaction(self) -> tuple[FreeRuns | None, FreeRuns | None]:
        """Free runs as they would be after a full compaction (None, None: as they are)."""
        if not self.frontier.unified:
            return None, None
        return self.frontier.runs_after(self.compaction_moves(keep_room=False))

    def refusal(self, request_ids: Sequence[str], low_count: int, high_count: int) -> DoesNotFit:
        """The refusal of a call that does not fit: NeedsCompaction when a full compaction makes room."""
        low_now, high_now = self.frontier.available()
        low_name = self.frontier.low.name if self.frontier.low else "slots"
        reason = (
            f"{len(request_ids)} request(s) need {low_count} {low_name} and {high_count} pages; available "
            f"now: {low_now} {low_name}, {high_now} pages"
        )
        counts = {"low": low_count, "pages": high_count, "low_free": low_now, "pages_free": high_now}
        if self.frontier.unified and self.frontier.fits(low_count, high_count, *self.runs_after_compaction()):
            return NeedsCompaction(request_ids[0], reason + "; compaction would make room", **counts)
        pinned = len(self.table.pinned_rows())
        reason += f" ({len(self.table)} live requests, {pinned} pinned)"
        return DoesNotFit(request_ids[0], reason, **counts, pinned=pinned)

    # ---- when moving pays -----------------------------------------------------------------------
    def window_pays(self, high_counts: list[int], rooms: list[int], low_count: int) -> bool:
        """Whether the batch's largest request, which no free run holds, would scatter at a higher
        cost than clearing one free run for it (the batch fits by count: the caller checked)."""
        if not self.targeted or not high_counts or not max(high_counts):
            return False
        floor = self.frontier.high_floor()
        if self.high_band.runs.largest(floor) >= max(high_counts):
            return False
        pieces = max(self.placement.extent_pieces(high_counts, floor, rooms, self.claims.live()))
        scatter = self.cost.of(0, 1, pieces)
        if scatter <= 0:
            return False
        need = NeedsCompaction("", "", low=low_count, pages=sum(high_counts), window=max(high_counts))
        low_pinned, high_pinned = self._pinned_masks()
        plan = self._page_plan(
            need, self._bottom(low_count, np.ones_like(low_pinned)), high_pinned, self.claims.room_mask()
        )
        return plan is not None and plan.cost_bytes < scatter

    def growth_window(
        self, rows: np.ndarray, counts: np.ndarray, low_runs: FreeRuns | None = None
    ) -> tuple[int, int] | None:
        """(pages, start) of the free run to clear when `rows` grow by `counts` pages (start -1:
        anywhere); None: grow as placement would. Only when exactly one of them grows elsewhere than
        right after its last page. Of three ways it pays the least: taking the extent placement
        gives it (`Placement.growth_positions`; each piece a run more), clearing one free run for it
        (a run more), or clearing the pages right after its last page (no run more)."""
        if not self.targeted:
            return None
        table, runs = self.table, self.high_band.runs.copy()
        vlast = table.last_vpage[rows]
        after = np.full(rows.size, runs.num_positions, dtype=np.int64)
        after[vlast >= 0] = self.high_band.physical(vlast[vlast >= 0]) + 1
        in_place = runs.take_after(after, counts)
        rest = counts - in_place
        moving = np.flatnonzero(rest)
        if moving.size != 1:
            return None
        i = int(moving[0])
        row, count = int(rows[i]), int(rest[i])
        floor, room = self.frontier.high_floor(low_runs), int(table.room[row])
        pieces = len(
            runs.take_extent(count, floor, self.placement.gap_keep, room=room, claims=self.claims.live())
        )
        runs_now = num_runs(self.high_band.physical(np.array(table.vpages[row], dtype=np.int64)))
        if pieces == 1 and runs_now < self.cost.max_runs:
            return None  # one run more, within the bound: nothing to clear is cheaper
        best, choice = self.cost.of(0, runs_now, runs_now + pieces), None
        low_stays = np.ones_like(self.low_band.owned)
        bottom, high_pinned, room_mask = (
            self._bottom(0, low_stays),
            self._pinned_masks()[1],
            self.claims.room_mask(),
        )
        start = int(after[i] + in_place[i])
        options = [(count, start, 0)] if vlast[i] >= 0 and start + count <= runs.num_positions else []
        if pieces > 1:
            options.append((count, -1, 1))
        for window, at, runs_added in options:
            need = NeedsCompaction("", "", pages=count, window=window, window_at=at)
            plan = self._page_plan(need, bottom, high_pinned, room_mask)
            if plan is not None and plan.cost_bytes + self.cost.of(0, runs_now, runs_now + runs_added) < best:
                best, choice = plan.cost_bytes, (window, at)
        return choice

    # ---- plans ------------------------------------------------------------------------------------
    def compaction_moves(
        self, *, keep_room: bool = False, need: NeedsCompaction | None = None
    ) -> CompactionMoves:
        """Moves that pack both bands around pinned requests (none for a static pool). Pure.

        keep_room: the free part of each request's growth claim stays right after its last page.
        Without it (the default) this is the full compaction a `NeedsCompaction` promises room
        after: growth room is a hint, and kept room could leave a promised request short.
        need: what a call lacked (see the module docstring); only what is in the way moves, when
        that is possible."""
        low_pinned, high_pinned = self._pinned_masks()
        room = self.claims.room_mask() if keep_room else None
        if need is not None and self.targeted:
            moves = self._targeted(need, low_pinned, high_pinned, room)
            if moves is not None:
                return moves
        # A full compaction. First fit keeps the baseline's unit-by-unit fill.
        slide = self.placement.mode == "extent"
        high_moves = self.high_band.compaction_moves(high_pinned, room, slide=slide)
        return self.frontier.compaction_moves(low_pinned, high_pinned, high_moves, high_slide=slide)

    def _pinned_masks(self) -> tuple[np.ndarray, np.ndarray]:
        low = np.zeros_like(self.low_band.owned)
        high = np.zeros_like(self.high_band.owned)
        table = self.table
        for r in table.pinned_rows():  # a loop over pinned requests, not positions
            vlow = [table.vslot[r]] if table.vslot[r] >= 0 else []
            low[self.low_band.physical(np.array(vlow + table.vswa[r], dtype=np.int64))] = True
            high[self.high_band.physical(np.array(table.vpages[r], dtype=np.int64))] = True
        return low, high

    def _targeted(
        self, need: NeedsCompaction, low_pinned: np.ndarray, high_pinned: np.ndarray, room: np.ndarray | None
    ) -> CompactionMoves | None:
        """Moves of only what is in the way of `need`, or None. The low band stays as it is where
        that serves (moving a slot costs as much as a hundred pages); it packs down first when the
        pages fit only below its highest unit."""
        for pack_low in (False, True):
            low_stays = low_pinned if pack_low else np.ones_like(low_pinned)
            plan = self._page_plan(need, self._bottom(need.low, low_stays), high_pinned, room)
            if plan is None:
                continue
            moves = self.frontier.compaction_moves(
                low_stays, high_pinned, (plan.src, plan.dst), high_slide=plan.slide
            )
            if self.frontier.fits(need.low, need.pages, *self.frontier.runs_after(moves)):
                return moves
        return None

    def _bottom(self, new_low: int, low_pinned: np.ndarray) -> int:
        """The page position that the low band reaches with `new_low` more units once its units
        that are not in `low_pinned` pack down (at its lowest free positions when all are)."""
        low, high = self.frontier.low, self.frontier.high
        if low is None or high is None:
            return 0
        if low_pinned.all():
            runs = self.low_band.runs
            top = lowest_free_top(runs, new_low) if 0 < new_low <= runs.num_free else -1
            return self.frontier.high_floor(extra_low_top=top)
        pinned_top = int(np.flatnonzero(low_pinned)[-1]) if low_pinned.any() else -1
        top = max(self.low_band.num_owned + new_low - 1, pinned_top)
        end = low.base_bytes + (top + 1) * low.stride_bytes
        return max(0, ceil_div(end - high.base_bytes, high.stride_bytes))

    def _page_plan(
        self, need: NeedsCompaction, bottom: int, high_pinned: np.ndarray, room: np.ndarray | None
    ) -> Evacuation | None:
        """The cheaper of two plans that free the pages below `bottom` and a run of `need.window`:
        moving the holders in the way elsewhere (evacuate.py), which may add runs, or sliding
        the stretch of the band that holds enough free pages up (slide.py), which adds none."""
        holders, rooms = self.sharing.holder_groups(self.table.live_rows())
        band, window = self.high_band, need.window
        plans = [
            evacuation_moves(
                band,
                high_pinned,
                self.claims.by_position,
                room,
                holders,
                rooms,
                self.cost,
                bottom=bottom,
                window=window,
                window_at=need.window_at,
            )
        ]
        if need.window_at >= 0:  # a slide would move the window's neighbours too
            return plans[0]
        slide = cheapest_slide(band, high_pinned, room, holders, bottom=bottom, window=window)
        if slide is not None:
            src, dst = slide_moves(band, high_pinned, room, slide)
            plans.append(
                Evacuation(src=src, dst=dst, cost_bytes=slide.pages_moved * self.cost.page_bytes, slide=True)
            )
        return min(
            (plan for plan in plans if plan is not None), key=lambda plan: plan.cost_bytes, default=None
        )
