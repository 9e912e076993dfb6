"""Plan a whole-envelope transfer: pure functions from byte ranges to coalesced runs and messages.

Both ends list their envelope as `(offset, nbytes)` rows in the same canonical order (slot, then
pages in token order); row i on one side pairs with row i on the other and has the same `nbytes`.
Concatenating the rows in that order gives the *stream*: the byte sequence the transfer moves.

    plan_runs(src, dst)  -> (m, 3) runs (src_offset, dst_offset, nbytes) in stream order, merged
                            where both sides continue contiguously
    (then `transfer.plans.messages.plan_messages(runs)` -> chunks of messages)

Both ends compute the same plan from the same two tables, so no per-message metadata travels.
Plans are numpy int64 arrays: they are small, host-side, and numpy's per-call cost is a fraction
of torch's.
"""

from __future__ import annotations

import numpy as np
import torch

from distpool.memory.arena import DST, NBYTES, SRC, merge_runs
from distpool.memory.envelope import moving_rows  # the rows a transfer moves: the envelope's rule
from transfer.plans.errors import (
    BAD_SHAPE,
    EMPTY,
    NEGATIVE,
    OVERLAPPING,
    PAST_ARENA,
    RangesRefused,
    RowsDoNotPair,
)

__all__ = [
    "DST",
    "NBYTES",
    "SRC",
    "check_ranges",
    "moving_rows",
    "plan_runs",
]


def check_ranges(ranges: torch.Tensor, arena_bytes: int, *, name: str = "ranges") -> None:
    """Raise RangesRefused unless `ranges` is an (n, 2) int64 table of disjoint ranges inside the arena."""
    if ranges.dtype != torch.int64 or ranges.dim() != 2 or ranges.shape[1] != 2:
        raise RangesRefused(name, BAD_SHAPE, shape=f"{tuple(ranges.shape)} {ranges.dtype}")
    if ranges.shape[0] == 0:
        raise RangesRefused(name, EMPTY)
    table = ranges.cpu().numpy()
    offsets, nbytes = table[:, 0], table[:, 1]
    if (offsets < 0).any() or (nbytes <= 0).any():
        raise RangesRefused(name, NEGATIVE)
    if (reach := int((offsets + nbytes).max())) > arena_bytes:
        raise RangesRefused(name, PAST_ARENA, reach=reach, arena_bytes=arena_bytes)
    order = np.argsort(offsets, kind="stable")
    if (offsets[order][1:] < (offsets + nbytes)[order][:-1]).any():
        raise RangesRefused(name, OVERLAPPING)


def plan_runs(src_ranges: torch.Tensor | np.ndarray, dst_ranges: torch.Tensor | np.ndarray) -> np.ndarray:
    """Pair rows and merge neighbours contiguous on both sides: (m, 3) int64 (src, dst, nbytes).

    Raises RowsDoNotPair when the tables cannot pair (row count or a row's nbytes differ).
    """
    src_table, dst_table = np.asarray(src_ranges, dtype=np.int64), np.asarray(dst_ranges, dtype=np.int64)
    if src_table.shape != dst_table.shape:
        raise RowsDoNotPair(src_table.shape[0], dst_table.shape[0])
    differ = np.flatnonzero(src_table[:, 1] != dst_table[:, 1])
    if differ.size:
        i = int(differ[0])
        rows = src_table.shape[0]
        raise RowsDoNotPair(rows, rows, row=i, src_bytes=int(src_table[i, 1]), dst_bytes=int(dst_table[i, 1]))
    return merge_runs(src_table[:, 0], dst_table[:, 0], src_table[:, 1])
