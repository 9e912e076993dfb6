"""The frontier between the arena's two bands: where a unit may be placed, and compaction moves.

Placement rule: a low unit is handed out only below the lowest live page, and a page only above the
highest live low unit, so the bands never overlap in bytes. In a unified arena both bands span the
whole usable region and the frontier moves with what is live; in a static arena the bands are
disjoint by construction and the rule never binds.

Compaction (moves first, then the copies): the low band packs down and the high band slides up around
pinned units (keeping each request's pages together, and its growth room after them unless told
otherwise), moving the frontier back to where the live units end. The moves are pure: unit moves per band
and byte runs `[src_offset, dst_offset, nbytes]`, one per stretch that is contiguous on both sides.
Every query can run on hypothetical free runs (e.g. "after compaction") as well as the real ones, and
costs O(1) or O(runs): the watermarks (lowest live page, highest live low unit) come from the ends of
the bands' free runs, never from a scan of their positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distpool.memory.arena.arena import BandGeometry
from distpool.memory.arena.band import Band
from distpool.memory.arena.free_runs import NO_POSITIONS, FreeRuns
from distpool.memory.arena.runs import NO_RUNS, merge_runs
from distpool.memory.sizing import ceil_div


@dataclass(frozen=True)
class CompactionMoves:
    """Unit moves per band (physical positions) and the byte runs that perform them."""

    low_moves: tuple[np.ndarray, np.ndarray]  # (src, dst) positions, int64
    high_moves: tuple[np.ndarray, np.ndarray]
    runs_bytes: np.ndarray  # (r, 3) int64 [src_offset, dst_offset, nbytes], one copy each

    @property
    def bytes_moved(self) -> int:
        return int(self.runs_bytes[:, 2].sum())


class Frontier:
    """Placement limits and compaction over a low band (grows up) and a high band (grows down)."""

    def __init__(
        self,
        low: BandGeometry | None,
        high: BandGeometry | None,
        low_band: Band,
        high_band: Band,
        *,
        unified: bool,
    ) -> None:
        self.low, self.high = low, high
        self.low_band, self.high_band = low_band, high_band
        self.unified = unified

    def low_limit(self, high_runs: FreeRuns | None = None) -> int:
        """Low positions below this index overlap no live page."""
        if self.low is None:
            return 0
        if self.high is None:
            return self.low.num_positions
        first = (high_runs or self.high_band.runs).lowest_owned()
        start = (
            self.high.end_bytes if first is None else self.high.base_bytes + first * self.high.stride_bytes
        )
        return min(self.low.num_positions, (start - self.low.base_bytes) // self.low.stride_bytes)

    def high_floor(self, low_runs: FreeRuns | None = None, extra_low_top: int = -1) -> int:
        """Page positions from this index up overlap no live low unit (nor one at `extra_low_top`).
        Every page position below it is free (pages are only ever placed at or above it)."""
        if self.low is None or self.high is None:
            return 0
        last = (low_runs or self.low_band.runs).highest_owned()
        last = max(-1 if last is None else last, extra_low_top)
        end = self.low.base_bytes + (last + 1) * self.low.stride_bytes
        return max(0, ceil_div(end - self.high.base_bytes, self.high.stride_bytes))

    def fits(
        self,
        low_count: int,
        high_count: int,
        low_runs: FreeRuns | None = None,
        high_runs: FreeRuns | None = None,
    ) -> bool:
        """Whether `low_count` low units (the lowest free ones) and then `high_count` pages above
        them can be placed. O(runs)."""
        low_runs = low_runs or self.low_band.runs
        high_runs = high_runs or self.high_band.runs
        top = -1
        if low_count:
            limit = self.low_limit(high_runs)
            # Every low position at or above the limit is free (low units only go below it).
            if low_runs.num_free - (low_runs.num_positions - limit) < low_count:
                return False
            top = lowest_free_top(low_runs, low_count)
        if high_count:
            return high_runs.num_free - self.high_floor(low_runs, top) >= high_count
        return True

    def available(
        self, low_runs: FreeRuns | None = None, high_runs: FreeRuns | None = None
    ) -> tuple[int, int]:
        """(low units, pages) placeable now; each figure counts the shared gap between the bands."""
        low_runs = low_runs or self.low_band.runs
        high_runs = high_runs or self.high_band.runs
        low = low_runs.num_free - (low_runs.num_positions - self.low_limit(high_runs)) if self.low else 0
        return low, high_runs.num_free - self.high_floor(low_runs)

    def compaction_moves(
        self,
        low_pinned: np.ndarray,
        high_pinned: np.ndarray,
        high_moves: tuple[np.ndarray, np.ndarray] | None = None,
        *,
        high_slide: bool = True,
    ) -> CompactionMoves:
        """Moves that pack the low band down and the high band up; pinned positions stay. Pure.
        high_moves: the pages' moves planned by the caller; by default the band's own full slide.
        The byte runs come in execution order (see `Arena.copy_runs`): the low band's (into free
        positions), then the pages': a slide's (`high_slide`, every page moving up) from the
        highest source down, other plans' in the order given."""
        if not self.unified:  # a fixed frontier: every hole is reusable where it is
            none = (NO_POSITIONS, NO_POSITIONS)
            return CompactionMoves(low_moves=none, high_moves=none, runs_bytes=NO_RUNS)
        low_moves = self.low_band.compaction_moves(low_pinned)
        high_moves = high_moves or self.high_band.compaction_moves(high_pinned)
        runs = [NO_RUNS]
        for geometry, (src, dst) in ((self.low, low_moves), (self.high, high_moves)):
            if geometry is not None and src.size:  # src ascending: units keep their order, runs stay long
                src_bytes = geometry.base_bytes + src * geometry.stride_bytes
                dst_bytes = geometry.base_bytes + dst * geometry.stride_bytes
                merged = merge_runs(src_bytes, dst_bytes, np.full_like(src_bytes, geometry.stride_bytes))
                runs.append(merged[::-1] if geometry is self.high and high_slide else merged)
        return CompactionMoves(low_moves=low_moves, high_moves=high_moves, runs_bytes=np.concatenate(runs))

    def runs_after(self, moves: CompactionMoves) -> tuple[FreeRuns, FreeRuns]:
        """(low, high) free runs once `moves` are applied (one numpy pass over positions)."""
        return (
            FreeRuns.from_owned(self.low_band.owned_after(*moves.low_moves)),
            FreeRuns.from_owned(self.high_band.owned_after(*moves.high_moves)),
        )

    def apply(self, moves: CompactionMoves) -> None:
        """Rewrite the band maps once the moves' bytes have been copied."""
        self.low_band.apply_moves(*moves.low_moves)
        self.high_band.apply_moves(*moves.high_moves)

    def bands_overlap(self) -> bool:
        """Whether any live low unit overlaps any live page in bytes (never, if the rule held)."""
        if self.low is None or self.high is None:
            return False
        last, first = self.low_band.highest_owned(), self.high_band.lowest_owned()
        if last is None or first is None:
            return False
        low_end = self.low.base_bytes + (last + 1) * self.low.stride_bytes
        return low_end > self.high.base_bytes + first * self.high.stride_bytes


def lowest_free_top(runs: FreeRuns, count: int) -> int:
    """The highest of the `count` lowest free positions (count >= 1 and that many are free)."""
    before = np.cumsum(runs.ends - runs.starts)
    run = int(np.searchsorted(before, count))
    return int(runs.ends[run]) - 1 - int(before[run] - count)
