"""The allocator's compaction plans and growth claims (a part of `Allocator`, kept apart for size).

Growth claims: `claims[p]` is the number of pages the request whose last page sits at p - 1 still
expects to grow by (`RequestTable.room`, from the final length given at reserve), 0 elsewhere.
Placement keeps the free part of a claim free while anything else fits; compaction keeps it after
its request unless told not to.

Compaction plans (pure; `ArenaPool.compact` copies the bytes, then `apply_compaction`):
- for a refusal's needs (`NeedsCompaction`: low units, a run of pages for a request that would
  scatter), only the requests in the way move (evacuate.py), when that is possible;
- otherwise a full compaction: the low band packs down, full pages slide up keeping each request's
  pages together (extent placement) or fill holes unit by unit (the first-fit baseline).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distpool.memory.band import require
from distpool.memory.evacuate import evacuation_moves
from distpool.memory.free_runs import FreeRuns
from distpool.memory.frontier import CompactionMoves
from distpool.memory.layout import ceil_div
from distpool.memory.pool import DoesNotFit, NeedsCompaction
from distpool.memory.requests import checked_batch
from distpool.memory.sharing import SharedPages


class CompactionPlans(SharedPages):
    """A base of `Allocator` (over `SharedPages`, which declares the allocator's state it reads);
    keeps the growth claims."""

    claims: np.ndarray

    # ---- when to compact -----------------------------------------------------------------------
    def _runs_after_compaction(self) -> tuple[FreeRuns | None, FreeRuns | None]:
        """Free runs as they would be after a full compaction (None, None: as they are)."""
        if not self.unified:
            return None, None
        return self.frontier.runs_after(self.compaction_moves(keep_room=False))

    def _refuse(
        self, request_ids: Sequence[str], low_count: int, high_count: int, whole: int = 0
    ) -> DoesNotFit:
        """The refusal: NeedsCompaction when a full compaction makes room (`whole`: the pages the
        largest request wants in one run, asked of the compaction when no free run holds them)."""
        low_now, high_now = self.available()
        low_name = self.low.name if self.low else "slots"
        reason = (
            f"{len(request_ids)} request(s) need {low_count} {low_name} and {high_count} pages; available "
            f"now: {low_now} {low_name}, {high_now} pages"
        )
        if self.unified and self.frontier.fits(low_count, high_count, *self._runs_after_compaction()):
            window = whole if self.high_band.runs.largest(self.frontier.high_floor()) < whole else 0
            return NeedsCompaction(
                request_ids[0],
                reason + "; compaction would make room: call compact()",
                low=low_count,
                window=window,
            )
        pinned = len(self.holdings.pinned_rows())
        return DoesNotFit(request_ids[0], reason + f" ({len(self.holdings)} live requests, {pinned} pinned)")

    def _compaction_keeps_whole(self, high_counts: list[int]) -> bool:
        """Whether the largest of `high_counts` would scatter over several free runs now, and a
        compaction would gather the pages free outside other requests' growth room to hold the batch."""
        if not self.unified or self.placement.mode != "extent" or not high_counts or not max(high_counts):
            return False
        runs = self.high_band.runs
        if runs.largest(self.frontier.high_floor()) >= max(high_counts):
            return False
        return self.frontier.available()[1] >= sum(high_counts)

    # ---- plans ---------------------------------------------------------------------------------
    def _pinned_masks(self) -> tuple[np.ndarray, np.ndarray]:
        low = np.zeros_like(self.low_band.owned)
        high = np.zeros_like(self.high_band.owned)
        table = self.holdings
        for r in table.pinned_rows():  # a loop over pinned requests, not positions
            vlow = [table.vslot[r]] if table.vslot[r] >= 0 else []
            low[self.low_band.physical(np.array(vlow + table.vswa[r], dtype=np.int64))] = True
            high[self.high_band.physical(np.array(table.vpages[r], dtype=np.int64))] = True
        return low, high

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
        room = self._room_mask() if keep_room else None
        if need is not None and self.placement.mode == "extent":
            evacuation = self._evacuation(need, low_pinned, high_pinned, room)
            if evacuation is not None:
                return self.frontier.compaction_moves(low_pinned, high_pinned, evacuation, high_slide=False)
        slide = self.placement.mode == "extent"  # first fit keeps the baseline's unit-by-unit fill
        high_moves = self.high_band.compaction_moves(high_pinned, room, slide=slide)
        return self.frontier.compaction_moves(low_pinned, high_pinned, high_moves, high_slide=slide)

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
        pages, rooms = self._page_groups(self.holdings.live_rows())
        return evacuation_moves(
            self.high_band,
            high_pinned,
            self.claims,
            room,
            pages,
            rooms,
            bottom=bottom,
            window=need.window,
        )

    def _room_mask(self) -> np.ndarray | None:
        """Free positions that are growth room: the first claims[s] positions of each free run
        starting at s. None when no run holds a claim."""
        runs = self.high_band.runs
        claimed = np.minimum(self.claims[runs.starts], runs.ends - runs.starts)
        has = np.flatnonzero(claimed > 0)
        if not has.size:
            return None
        edges = np.zeros(self.high_band.num_positions + 1, dtype=np.int64)
        np.add.at(edges, runs.starts[has], 1)
        np.add.at(edges, runs.starts[has] + claimed[has], -1)
        return np.cumsum(edges[:-1]) > 0

    def apply_compaction(self, moves: CompactionMoves) -> None:
        """Rewrite the maps once the moves' bytes have been copied."""
        self.frontier.apply(moves)
        self.claims[:] = 0
        self._set_claims(self.holdings.live_rows())

    # ---- growth claims -------------------------------------------------------------------------
    def _rooms(self, ids: Sequence[str], counts: list[int], final_tokens: Sequence[int] | None) -> list[int]:
        """Pages each reserved request expects to grow by, from its final length (0 without one)."""
        if final_tokens is None:
            return [0] * len(counts)
        if len(final_tokens) != len(counts):
            raise ValueError(f"reserve: {len(final_tokens)} final lengths for {len(counts)} requests")
        _, finals = checked_batch(list(zip(ids, final_tokens, strict=True)), "reserve (final length)")
        pages = self.pages_for
        return [max(0, pages(f) - pages(n)) for f, n in zip(finals.tolist(), counts, strict=True)]

    def _live_claims(self) -> np.ndarray | None:
        """The claims, or None while no request expects to grow (placement skips the lookups)."""
        return self.claims if self.holdings.room.any() else None

    def _ends(self, rows: np.ndarray) -> np.ndarray:
        """Position after each row's last page (0 for a row without pages: no page ends there)."""
        vlast = self.holdings.last_vpage[rows]
        ends = np.zeros(vlast.shape, dtype=np.int64)
        paged = vlast >= 0  # never index the page band for a row without pages: it may have none
        ends[paged] = self.high_band.physical(vlast[paged]) + 1
        return ends

    def _set_claims(self, rows: np.ndarray) -> None:
        ends = self._ends(rows)
        self.claims[ends] = np.where(ends > 0, self.holdings.room[rows], 0)

    def _clear_claims(self, rows: np.ndarray) -> None:
        self.claims[self._ends(rows)] = 0

    def _check_claims(self) -> None:
        live = self.holdings.live_rows()
        ends = self._ends(live)
        expected = np.zeros_like(self.claims)
        expected[ends] = np.where(ends > 0, self.holdings.room[live], 0)
        require(
            np.array_equal(expected, self.claims), "growth claims sit right after their requests' last pages"
        )
