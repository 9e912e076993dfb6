"""Free runs of one band: the positions nobody owns, as sorted, disjoint, coalesced [start, end) runs.

Every query and change costs O(runs touched) or one numpy pass over the runs, never a pass over the
band's positions, so a reserve on a 65k-position band costs what a reserve on a 64-position band does.
Most takes come off one end of a run (first fit from either end, growth from a run's start); an
extent that leaves another request's growth room free before it, or its own after it, splits a run
in two (one insert into the run arrays). A run emptied by a take stays as an empty row until
`_drop_empty` (once per batch), which keeps every take O(1) after its lookup.

    positions  0    4         9   12        16
    owned      ....####......###.....####....        runs: [0, 4) [8, 9)... one row each
"""

from __future__ import annotations

import numpy as np

NO_POSITIONS = np.empty(0, dtype=np.int64)


class FreeRuns:
    """Sorted free runs of a band of `num_positions` positions (all free at first)."""

    def __init__(self, num_positions: int) -> None:
        self.num_positions = num_positions
        self.starts = np.array([0] if num_positions else [], dtype=np.int64)
        self.ends = np.array([num_positions] if num_positions else [], dtype=np.int64)
        self.num_free = num_positions

    @classmethod
    def from_owned(cls, owned: np.ndarray) -> FreeRuns:
        """Runs of the False stretches of a bool mask (one numpy pass over positions)."""
        runs = cls(owned.size)
        free = np.concatenate([[False], ~owned, [False]]).astype(np.int8)
        edges = np.diff(free)
        runs.starts = np.flatnonzero(edges == 1).astype(np.int64)
        runs.ends = np.flatnonzero(edges == -1).astype(np.int64)
        runs.num_free = int((runs.ends - runs.starts).sum())
        return runs

    def copy(self) -> FreeRuns:
        other = FreeRuns(0)
        other.num_positions, other.num_free = self.num_positions, self.num_free
        other.starts, other.ends = self.starts.copy(), self.ends.copy()
        return other

    # ---- watermarks (O(1)) ---------------------------------------------------------------------
    def lowest_owned(self) -> int | None:
        """Lowest owned position, or None when everything is free."""
        if self.num_free == self.num_positions:
            return None
        return int(self.ends[0]) if self.starts.size and self.starts[0] == 0 else 0

    def highest_owned(self) -> int | None:
        """Highest owned position, or None when everything is free."""
        if self.num_free == self.num_positions:
            return None
        top = self.num_positions
        return int(self.starts[-1]) - 1 if self.ends.size and self.ends[-1] == top else top - 1

    # ---- takes -----------------------------------------------------------------------------------
    def take_lowest(self, count: int) -> np.ndarray:
        """The `count` lowest free positions, ascending (caller checked they exist)."""
        return self._take_from_end(count, 0, lowest=True)

    def take_highest(self, count: int, lo: int = 0) -> np.ndarray:
        """The `count` highest free positions at or above `lo`, descending (caller checked)."""
        return self._take_from_end(count, lo, lowest=False)

    def _take_from_end(self, count: int, lo: int, *, lowest: bool) -> np.ndarray:
        if count == 0:
            return NO_POSITIONS
        starts = np.maximum(self.starts, lo)
        lengths = np.maximum(self.ends - starts, 0)
        order = np.arange(lengths.size) if lowest else np.arange(lengths.size)[::-1]
        before = np.cumsum(lengths[order]) - lengths[order]  # free positions in earlier runs
        used = order[before < count]
        take = np.minimum(lengths[used], count - before[before < count])
        if lowest:
            pieces = [np.arange(s, s + t) for s, t in zip(starts[used].tolist(), take.tolist(), strict=True)]
            self.starts[used] += take
        else:
            ends = self.ends[used]
            pieces = [
                np.arange(e - 1, e - t - 1, -1) for e, t in zip(ends.tolist(), take.tolist(), strict=True)
            ]
            self.ends[used] = ends - take
        self.num_free -= count
        self._drop_empty()
        return np.concatenate(pieces)

    def take_extent(
        self, count: int, lo: int, gap_keep: int = 0, *, room: int = 0, claims: np.ndarray | None = None
    ) -> list[tuple[int, int]]:
        """`count` positions at or above `lo` in as few (start, length) pieces as possible, ascending.

        The run that starts at position 0 is the open gap above the other band (every position
        below `lo` lies in it); the others are holes between owned positions. `claims[p]` (a
        position-indexed array, optional) is the growth the request whose last page sits at p - 1
        still expects: the first claims[p] positions of a hole starting at p are that request's
        room, left free while anything else fits. `room` is the growth this extent's own request
        expects, kept free right after it where it can be. In order of preference:
        1. with `room`: the best-fitting hole (smallest, ties to the highest) holding `count + room`
           past its claim, the piece right after the claim; else the gap, if it keeps `gap_keep`
           free besides, the piece `room` below its top;
        2. the best-fitting hole holding `count` past its claim;
        3. the top of the gap, packed against the units above, if it keeps `gap_keep` positions
           free for the other band (a gap squeezed shut forces a compaction for the next slot);
        4. the hole holding `count` that takes least of its claim (then the smallest), at its top
           end, so the claimant keeps the start of its room; then the gap;
        5. the largest holes, then the gap, until `count` is covered (several pieces).
        Caller checked the total. Emptied runs stay until `finish_batch`.
        """
        starts = np.maximum(self.starts, lo)
        lengths = np.maximum(self.ends - starts, 0)
        gap = 0 if self.starts.size and self.starts[0] == 0 else -1
        gap_length = int(lengths[0]) if gap == 0 else 0
        gap_top = int(self.ends[0]) if gap == 0 else 0
        open_starts, open_lengths = starts, lengths
        if claims is not None and lengths.size:
            claimed = np.where(starts == self.starts, np.minimum(claims[self.starts], lengths), 0)
            open_starts, open_lengths = starts + claimed, lengths - claimed
        if room:
            run = self._best_fit(open_lengths, count + room, gap)
            if run >= 0:
                return self._take_one(run, int(open_starts[run]), count)
            if gap_length - count - room >= gap_keep:
                return self._take_one(0, gap_top - room - count, count)
        run = self._best_fit(open_lengths, count, gap)
        if run >= 0:
            return self._take_one(run, int(open_starts[run]), count)
        if gap_length - count >= gap_keep:
            return self._take_one(0, gap_top - count, count)
        run = self._least_claimed(lengths, open_lengths, count, gap) if claims is not None else -1
        if run >= 0:  # at the hole's top, so its claimant keeps the start of its room
            return self._take_one(run, int(self.ends[run]) - count, count)
        if gap_length >= count:
            return self._take_one(0, gap_top - count, count)
        order_key = -lengths
        if gap == 0:
            order_key[0] = 1  # the gap last
        by_size = np.argsort(order_key, kind="stable")
        covered = np.cumsum(lengths[by_size])
        num_runs = int(np.searchsorted(covered, count)) + 1
        used = by_size[:num_runs]
        takes = lengths[used].copy()
        takes[-1] -= int(covered[num_runs - 1]) - count
        pieces = []
        for run, take in sorted(zip(used.tolist(), takes.tolist(), strict=True)):
            if run == gap:
                self.ends[run] -= take
                pieces.append((int(self.ends[run]), take))
            else:
                pieces.append((int(starts[run]), take))
                self.starts[run] += take
        self.num_free -= count
        return sorted(pieces)

    def largest(self, lo: int = 0) -> int:
        """The longest free run's length at or above `lo` (0: nothing free)."""
        lengths = self.ends - np.maximum(self.starts, lo)
        return max(int(lengths.max()), 0) if lengths.size else 0

    def _best_fit(self, lengths: np.ndarray, count: int, gap: int) -> int:
        """The smallest hole (not the gap) of `lengths` holding `count`, the highest of equals; -1: none."""
        if not lengths.size:
            return -1
        misfit = self.num_positions + 1
        fitting = np.where(lengths >= count, lengths, misfit)
        if gap == 0:
            fitting[0] = misfit
        best = lengths.size - 1 - int(fitting[::-1].argmin())  # reversed: argmin's first is the highest
        return best if fitting[best] < misfit else -1

    def _least_claimed(self, lengths: np.ndarray, open_lengths: np.ndarray, count: int, gap: int) -> int:
        """The hole (not the gap) holding `count` that takes least from its claim, the smallest of
        those, the highest of equals; -1: none."""
        if not lengths.size:
            return -1
        overlap = np.maximum(count - open_lengths, 0).astype(np.float64)
        key = np.where(lengths >= count, overlap * (self.num_positions + 1) + lengths, np.inf)
        if gap == 0:
            key[0] = np.inf
        best = lengths.size - 1 - int(key[::-1].argmin())
        return best if np.isfinite(key[best]) else -1

    def _take_one(self, run: int, at: int, count: int) -> list[tuple[int, int]]:
        """Take [at, at + count) from run `run`; a take from its middle splits it in two."""
        start, end = int(self.starts[run]), int(self.ends[run])
        if at == start:
            self.starts[run] += count
        elif at + count == end:
            self.ends[run] -= count
        else:
            self.starts = np.insert(self.starts, run + 1, at + count)
            self.ends = np.insert(self.ends, run + 1, end)
            self.ends[run] = at
        self.num_free -= count
        return [(at, count)]

    def take_after(self, positions: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Grow in place: for each position p (each the start of a different run, or not free), take
        up to counts[i] positions from p upward; returns how many each took (0 where p is owned)."""
        inside = positions < self.num_positions
        run = np.searchsorted(self.starts, positions, side="right") - 1
        hit = inside & (run >= 0) & (self.starts[np.maximum(run, 0)] == positions)
        run = np.maximum(run, 0)
        taken = np.where(hit, np.minimum(counts, self.ends[run] - positions), 0)
        self.starts[run[hit]] += taken[hit]
        self.num_free -= int(taken.sum())
        return taken

    def finish_batch(self) -> None:
        """Drop the runs a batch of takes emptied."""
        self._drop_empty()

    def _drop_empty(self) -> None:
        keep = self.ends > self.starts
        if not keep.all():
            self.starts, self.ends = self.starts[keep], self.ends[keep]

    # ---- gives -----------------------------------------------------------------------------------
    def give(self, positions: np.ndarray) -> None:
        """Free `positions` (owned, distinct, any order): one sort of them plus one merge with the runs."""
        if positions.size == 0:
            return
        positions = np.sort(positions)
        breaks = np.flatnonzero(np.diff(positions) != 1) + 1
        new_starts = positions[np.concatenate([[0], breaks])]
        new_ends = positions[np.concatenate([breaks - 1, [positions.size - 1]])] + 1
        starts = np.concatenate([self.starts, new_starts])
        ends = np.concatenate([self.ends, new_ends])
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
        joins = np.flatnonzero(starts[1:] == ends[:-1])  # a run that begins where the previous ends
        if joins.size:
            first = np.ones(starts.size, dtype=bool)
            first[joins + 1] = False
            group_ends = np.maximum.reduceat(ends, np.flatnonzero(first))
            starts, ends = starts[first], group_ends
        self.starts, self.ends = starts, ends
        self.num_free += positions.size

    # ---- invariants ------------------------------------------------------------------------------
    def matches(self, owned: np.ndarray) -> bool:
        """Whether the runs are exactly the free stretches of `owned`, sorted and coalesced."""
        expected = FreeRuns.from_owned(owned)
        return (
            np.array_equal(expected.starts, self.starts)
            and np.array_equal(expected.ends, self.ends)
            and expected.num_free == self.num_free
        )
