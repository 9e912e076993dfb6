"""What the allocator optimises: the bytes compaction copies now against the byte runs every transfer
of an envelope pays for later, in one unit (bytes of copying).

- Copying a page costs its bytes: compaction copies inside the arena at the arena's copy bandwidth.
- A byte run of an envelope costs each transfer a message of its own: `run_bytes` is that overhead
  in bytes of copying (seconds per run x copy bandwidth, both measured; README, "What the allocator
  optimises"). On the machines measured it is about one page, so a run is cheap next to moving a
  request.
- Runs beyond `max_runs` per envelope cost `over_run_bytes` more each: the bound that keeps the
  tail of envelopes in few runs. Above it, moving a request of up to that many bytes to save one
  run pays; below it, almost nothing does.

    cost(envelope of r runs) = run_bytes * r + over_run_bytes * max(0, r - max_runs)
    cost(plan)               = bytes copied + sum over envelopes of (cost after - cost before)

Every choice the allocator makes between scattering and moving compares these sums: placing a new
request in several free runs or clearing one run for it, moving a request in the way whole or only
its pages in the way, growing a request elsewhere or moving it whole to where it can grow, and
moving a scattered request whole into one free run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Bytes of copying one more byte run of an envelope costs: a run costs a transfer about 20 us (one
# message and its plan; scripts/bench_transfer.py, "run cost"), compaction copies about 10 GB/s on
# a CPU arena (scripts/bench_pool.py, section e): 20e-6 * 10e9 = 200 KB.
RUN_BYTES = 200_000
# The pages of an envelope in at most this many byte runs (8 with its state slot) unless a run more
# saves copying OVER_RUN_BYTES: the tail bound (scripts/bench_pool.py, runs per envelope p99 <= 8).
MAX_PAGE_RUNS = 4
OVER_RUN_BYTES = 384 << 20  # the price of one run beyond the bound: moving ~1,000 384-KiB pages


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
        return self.run_bytes * runs + self.over_run_bytes * np.maximum(np.asarray(runs) - self.max_runs, 0)

    def of(self, pages_moved: int, runs_before: int | np.ndarray, runs_after: int | np.ndarray) -> float:
        """The cost of moving `pages_moved` pages that takes envelopes from `runs_before` to
        `runs_after` byte runs (negative: runs joined, a saving)."""
        change = np.sum(self.envelope(runs_after)) - np.sum(self.envelope(runs_before))
        return float(pages_moved * self.page_bytes + change)
