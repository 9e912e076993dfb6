"""Byte runs: rows of (src_offset, dst_offset, nbytes) merged where both sides continue contiguously.

Compaction (unit moves inside one arena) and the transfer plan (rows of two arenas) both turn
row-by-row moves into as few copies as possible with `merge_runs`. Compaction plans count the runs
of a request's pages (`num_runs`): each one is a byte run of its envelope.
"""

from __future__ import annotations

import numpy as np

SRC, DST, NBYTES = 0, 1, 2  # columns of a run table
NO_RUNS = np.empty((0, 3), dtype=np.int64)


def merge_runs(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """(m, 3) int64 runs from rows in order: row i joins row i-1 when both its source and its
    destination start exactly where row i-1 ended."""
    src, dst, nbytes = (np.asarray(a, dtype=np.int64) for a in (src, dst, nbytes))
    if src.size == 0:
        return NO_RUNS
    follows = (src[1:] == src[:-1] + nbytes[:-1]) & (dst[1:] == dst[:-1] + nbytes[:-1])
    first_rows = np.flatnonzero(np.concatenate([[True], ~follows]))
    return np.stack([src[first_rows], dst[first_rows], np.add.reduceat(nbytes, first_rows)], axis=1)


def num_runs(positions: np.ndarray) -> int:
    """Maximal stretches of consecutive ascending unit positions, in order (0 for none)."""
    return int(positions.size > 0) + int(np.count_nonzero(np.diff(positions) != 1))
