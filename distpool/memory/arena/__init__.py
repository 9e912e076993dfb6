"""The bytes: the arena's buffer and views, its bands of ids, their free runs, and byte runs.

`arena.py`: one uint8 tensor holding every page and slot, and zero-copy per-layer views of it;
`band.py`: one band's ids (owned positions, virtual <-> physical maps) with its sorted free runs
(`free_runs.py`); `frontier.py`: where a unit may be placed between the two bands, and compaction
moves; `runs.py`: (src, dst, nbytes) byte runs, merged, as compaction and the transfer plan copy them.
"""

from distpool.memory.arena.arena import SLIDE_STAGING_BYTES, Arena, BandGeometry
from distpool.memory.arena.band import Band, require
from distpool.memory.arena.free_runs import NO_POSITIONS, FreeRuns
from distpool.memory.arena.frontier import CompactionMoves, Frontier, lowest_free_top
from distpool.memory.arena.runs import DST, NBYTES, SRC, merge_runs, num_runs

__all__ = [
    "Arena",
    "Band",
    "BandGeometry",
    "CompactionMoves",
    "DST",
    "FreeRuns",
    "Frontier",
    "NBYTES",
    "NO_POSITIONS",
    "SLIDE_STAGING_BYTES",
    "SRC",
    "lowest_free_top",
    "merge_runs",
    "num_runs",
    "require",
]
