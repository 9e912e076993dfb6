"""A high band laid out by hand, for the compaction plans' tests (evacuate.py, slide.py)."""

from __future__ import annotations

import numpy as np

from distpool.memory.arena.band import Band
from distpool.memory.arena.free_runs import FreeRuns


def make_band(size: int, holders: list[list[int]]) -> tuple[Band, list[np.ndarray]]:
    """A high band of `size` positions whose holder i owns `holders[i]` (positions in token order),
    and each holder's positions as an int64 array."""
    band = Band(size, grows_up=False)
    pages = [np.array(positions, dtype=np.int64) for positions in holders]
    for physical in pages:
        band.assign(physical)
    band.runs = FreeRuns.from_owned(band.owned)
    return band, pages
