"""What the allocator optimises: the bytes compaction copies now against the byte runs an envelope
is in when it is transferred, in one unit (bytes of copying).

- Copying a page costs its bytes: compaction copies inside the arena at the arena's copy bandwidth.
- A byte run of an envelope costs each transfer one more slice copy on each side (gather, scatter:
  transfer/ends/staging.py). `run_bytes` is that time in bytes of compaction copying. It is tiny next to
  a page, so below the bound no move pays for the runs it saves: the allocator then copies as
  little as it can.
- Runs beyond `max_runs` per envelope's pages cost `over_run_bytes` more each. That is the bound on
  the tail (runs per envelope p99 <= 8 with the state slot, scripts/bench_pool.py), priced so that
  moving up to that many bytes to stay within it pays: a policy, not a measurement.

    cost(envelope of r runs) = run_bytes * r + over_run_bytes * max(0, r - max_runs)
    cost(plan)               = bytes copied + sum over envelopes of (cost after - cost before)

Every choice the compaction planner makes between scattering and moving compares these sums:
placing a new request in several free runs or clearing one run for it, growing a request elsewhere
in several pieces or clearing one run for its growth, and moving a request in the way whole or only
its pages in the way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# One more byte run costs a transfer about 1 us (a slice copy on each side; scripts/bench_pool.py
# section (e), "a transfer's byte run": 0.8 us on a loaded 2-core CPU), and compaction copies 1.5-10
# GB/s (same section): 1 us x 8 GB/s. Next to a page (384 KiB on the churn traces) it is nothing.
RUN_BYTES = 8_000
# The pages of an envelope in at most this many byte runs unless one more saves copying
# OVER_RUN_BYTES. Growth adds runs after the reserve (up to one per extend that cannot continue in
# place), so the bound sits below the p99 <= 8 target of the envelope (slot included).
MAX_PAGE_RUNS = 4
OVER_RUN_BYTES = 384 << 20  # the price of one run past the bound: moving ~1,000 384-KiB pages


@dataclass(frozen=True)
class MoveCost:
    """Costs in bytes of copying: `page_bytes` per page moved, `run_bytes` per byte run of an
    envelope's pages, `over_run_bytes` more per run beyond `max_runs`."""

    page_bytes: int
    run_bytes: float = RUN_BYTES
    max_runs: int = MAX_PAGE_RUNS
    over_run_bytes: float = OVER_RUN_BYTES

    def envelope(self, runs: int | np.ndarray) -> float | np.ndarray:
        """The transfer cost of envelopes whose pages lie in `runs` byte runs."""
        runs = np.asarray(runs)
        return self.run_bytes * runs + self.over_run_bytes * np.maximum(runs - self.max_runs, 0)

    def of(self, pages_moved: int, runs_before: int | np.ndarray, runs_after: int | np.ndarray) -> float:
        """The cost of moving `pages_moved` pages that takes envelopes from `runs_before` to
        `runs_after` byte runs (negative: runs joined, a saving)."""
        change = np.sum(self.envelope(runs_after)) - np.sum(self.envelope(runs_before))
        return float(pages_moved * self.page_bytes + change)
