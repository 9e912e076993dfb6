"""The frontier between the arena's two bands: where a unit may be placed, and compaction moves.

Placement rule: a low unit is handed out only below the lowest live page, and a page only above the
highest live low unit, so the bands never overlap in bytes. In a unified arena both bands span the
whole usable region and the frontier moves with what is live; in a static arena the bands are
disjoint by construction and the rule never binds.

Compaction (moves first, then the copies): the low band packs down and the high band packs up around pinned
units, moving the frontier back to where the live units end. The moves are pure: unit moves per band
and byte runs `[src_offset, dst_offset, nbytes]`, one per stretch that is contiguous on both sides.
Every query can run on hypothetical ownership masks (e.g. "after compaction") as well as the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from distpool.memory.arena import BandGeometry
from distpool.memory.band import EMPTY_IDS as _EMPTY
from distpool.memory.band import Band
from distpool.memory.layout import ceil_div
from distpool.memory.runs import NO_RUNS, merge_runs


@dataclass(frozen=True)
class CompactionMoves:
    """Unit moves per band (physical positions) and the byte runs that perform them."""

    low_moves: tuple[torch.Tensor, torch.Tensor]  # (src, dst) positions
    high_moves: tuple[torch.Tensor, torch.Tensor]
    runs_bytes: np.ndarray  # (r, 3) int64 [src_offset, dst_offset, nbytes], one copy each

    @property
    def bytes_moved(self) -> int:
        return int(self.runs_bytes[:, 2].sum())


class Frontier:
    """Placement and compaction over a low band (grows up) and a high band (grows down)."""

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

    def low_limit(self, high_owned: torch.Tensor | None = None) -> int:
        """Low positions below this index overlap no live page."""
        if self.low is None:
            return 0
        if self.high is None:
            return self.low.num_positions
        first = self.high_band.first_owned(high_owned)
        start = (
            self.high.end_bytes if first is None else self.high.base_bytes + first * self.high.stride_bytes
        )
        return min(self.low.num_positions, (start - self.low.base_bytes) // self.low.stride_bytes)

    def high_floor(self, low_owned: torch.Tensor | None = None, extra_low: torch.Tensor = _EMPTY) -> int:
        """Page positions from this index up overlap no live (or `extra_low`) low unit."""
        if self.low is None or self.high is None:
            return 0
        last = self.low_band.last_owned(low_owned)
        if extra_low.numel():
            last = max(-1 if last is None else last, int(extra_low.max()))
        end = 0 if last is None else self.low.base_bytes + (last + 1) * self.low.stride_bytes
        return max(0, ceil_div(end - self.high.base_bytes, self.high.stride_bytes))

    def fit(
        self,
        low_count: int,
        high_count: int,
        low_owned: torch.Tensor | None = None,
        high_owned: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Positions for `low_count` low units, then `high_count` pages above them; None if no room.
        Positions come in hand-out order: low ascending, high descending."""
        # Zero counts skip the watermark scans: most decode-step extends take no unit at all.
        low_pos = high_pos = _EMPTY
        if low_count:
            low_pos = self.low_band.pick(low_count, 0, self.low_limit(high_owned), low_owned)
            if low_pos is None:
                return None
        if high_count:
            floor = self.high_floor(low_owned, low_pos)
            high_pos = self.high_band.pick(high_count, floor, self.high_band.num_positions, high_owned)
        return None if high_pos is None else (low_pos, high_pos)

    def available(
        self, low_owned: torch.Tensor | None = None, high_owned: torch.Tensor | None = None
    ) -> tuple[int, int]:
        """(low units, pages) placeable now; each figure counts the shared gap between the bands."""
        low_owned = self.low_band.owned if low_owned is None else low_owned
        high_owned = self.high_band.owned if high_owned is None else high_owned
        limit, floor = self.low_limit(high_owned), self.high_floor(low_owned)
        low = limit - int(low_owned[:limit].sum())
        high = self.high_band.num_positions - floor - int(high_owned[floor:].sum())
        return low, high

    def compaction_moves(self, low_pinned: torch.Tensor, high_pinned: torch.Tensor) -> CompactionMoves:
        """Moves that pack the low band down and the high band up; pinned positions stay. Pure."""
        if not self.unified:  # a fixed frontier: every hole is reusable where it is
            return CompactionMoves(
                low_moves=(_EMPTY, _EMPTY), high_moves=(_EMPTY, _EMPTY), runs_bytes=NO_RUNS
            )
        low_moves = self.low_band.compaction_moves(low_pinned)
        high_moves = self.high_band.compaction_moves(high_pinned)
        runs = [NO_RUNS]
        for geometry, (src, dst) in ((self.low, low_moves), (self.high, high_moves)):
            if geometry is not None and src.numel():
                order = torch.argsort(src)  # units keep their relative order: runs stay long
                src_bytes = geometry.offsets(src[order]).numpy()
                dst_bytes = geometry.offsets(dst[order]).numpy()
                runs.append(merge_runs(src_bytes, dst_bytes, np.full_like(src_bytes, geometry.stride_bytes)))
        return CompactionMoves(low_moves=low_moves, high_moves=high_moves, runs_bytes=np.concatenate(runs))

    def owned_after(self, moves: CompactionMoves) -> tuple[torch.Tensor, torch.Tensor]:
        """(low, high) ownership masks once `moves` are applied."""
        return self.low_band.owned_after(*moves.low_moves), self.high_band.owned_after(*moves.high_moves)

    def apply(self, moves: CompactionMoves) -> None:
        """Rewrite the band maps once the moves' bytes have been copied."""
        self.low_band.apply_moves(*moves.low_moves)
        self.high_band.apply_moves(*moves.high_moves)

    def bands_overlap(self) -> bool:
        """Whether any live low unit overlaps any live page in bytes (never, if the rule held)."""
        if self.low is None or self.high is None:
            return False
        last, first = self.low_band.last_owned(), self.high_band.first_owned()
        if last is None or first is None:
            return False
        low_end = self.low.base_bytes + (last + 1) * self.low.stride_bytes
        return low_end > self.high.base_bytes + first * self.high.stride_bytes
