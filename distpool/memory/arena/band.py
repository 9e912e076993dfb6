"""Ids of one band: which physical positions are owned, and the virtual <-> physical maps.

A band knows nothing of bytes, requests or the other band; the allocator combines two of them.
State (numpy, length `num_positions`):
- `owned[p]`  — physical position p holds a live unit (bool).
- `p2v[p]`    — the virtual id living at p, or -1 where p is free (int64).
- `v2p[v]`    — the physical position of virtual id v, or -1 where v is unused (int64).
- `runs`      — the free positions as sorted runs (free_runs.py): what placement searches.
- a stack of unused virtual ids, so handing out ids never scans `v2p`.
Invariant: v2p and p2v are inverse bijections between used virtual ids and owned positions, and
`runs` are exactly the free stretches of `owned`. Assign and free cost O(units), never O(positions);
only compaction planning and `check` pass over every position (numpy, no Python loop).
"""

from __future__ import annotations

import numpy as np

from distpool.memory.arena.free_runs import NO_POSITIONS, FreeRuns
from distpool.memory.errors import InvariantBroken


class Band:
    """Physical positions and virtual ids of `num_positions` fixed-stride units.

    `grows_up`: compaction packs units toward the low end (the low band) or the high end (the high
    band); where new units go is the placement's business (placement.py).
    """

    def __init__(self, num_positions: int, *, grows_up: bool) -> None:
        self.num_positions = num_positions
        self.grows_up = grows_up
        self.owned = np.zeros(num_positions, dtype=bool)
        self.p2v = np.full(num_positions, -1, dtype=np.int64)
        self.v2p = np.full(num_positions, -1, dtype=np.int64)
        self.runs = FreeRuns(num_positions)
        # Unused virtual ids, the next one handed out last: 0, 1, 2, ... on a fresh band.
        self._unused_virtual = np.arange(num_positions - 1, -1, -1, dtype=np.int64)
        self._num_unused_virtual = num_positions

    @property
    def num_owned(self) -> int:
        return self.num_positions - self.runs.num_free

    def lowest_owned(self) -> int | None:
        return self.runs.lowest_owned()

    def highest_owned(self) -> int | None:
        return self.runs.highest_owned()

    # ---- changing ownership ------------------------------------------------------------------
    def assign(self, physical: np.ndarray) -> np.ndarray:
        """Own `physical` (positions the caller already took out of `runs`); returns their new
        virtual ids, one per position in the same order."""
        n = physical.size
        if n == 0:
            return NO_POSITIONS
        top = self._num_unused_virtual
        virtual = self._unused_virtual[top - n : top][::-1].copy()
        self._num_unused_virtual = top - n
        self.v2p[virtual] = physical
        self.p2v[physical] = virtual
        self.owned[physical] = True
        return virtual

    def free(self, virtual: np.ndarray) -> None:
        """Give back the units behind `virtual` (used virtual ids)."""
        if virtual.size == 0:
            return
        physical = self.v2p[virtual]
        if (physical < 0).any():
            raise ValueError(f"free of unused virtual ids {virtual[physical < 0].tolist()}")
        self.owned[physical] = False
        self.p2v[physical] = -1
        self.v2p[virtual] = -1
        top = self._num_unused_virtual
        self._unused_virtual[top : top + virtual.size] = virtual
        self._num_unused_virtual = top + virtual.size
        self.runs.give(physical)

    def physical(self, virtual: np.ndarray) -> np.ndarray:
        return self.v2p[virtual]

    # ---- compaction ----------------------------------------------------------------------------
    def compaction_moves(
        self, pinned: np.ndarray, room: np.ndarray | None = None, *, slide: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) positions that pack the band toward its growing end; `pinned` positions stay.

        Low end (grows up; slots and window pages, where a request holds one unit or order does not
        matter), and the high end with `slide=False` (the first-fit baseline): the movable units on
        the positions nearest the growing end that are not pinned. Units already on a target
        position stay; every other unit moves to a target position that is free now, so no
        destination is any unit's source (but a request's pages may land out of order).

        High end (full pages): a slide. The movable units and the free positions of `room` (growth
        room right after a request's last page, as placeholders) keep their order on the highest
        positions that are not pinned, so a request's pages stay ascending and adjacent with its
        room after them, and the free positions gather below. Every unit moves up or stays:
        copied highest first, a unit's destination is free or belongs to a unit that has already
        moved further up.
        """
        movable = self.owned & ~pinned
        candidates = np.flatnonzero(~pinned)  # ascending
        if self.grows_up or not slide:
            num_movable = int(movable.sum())
            targets = (
                candidates[:num_movable] if self.grows_up else candidates[candidates.size - num_movable :]
            )
            target_mask = np.zeros_like(self.owned)
            target_mask[targets] = True
            src = np.flatnonzero(movable & ~target_mask)
            dst = np.flatnonzero(target_mask & ~self.owned)
            if src.size != dst.size:
                raise RuntimeError(f"a compaction plan moves {src.size} units into {dst.size} free places")
            return src, dst  # both ascending
        items_mask = movable if room is None else movable | (room & ~self.owned)
        items = np.flatnonzero(items_mask)
        targets = candidates[candidates.size - items.size :]
        units = self.owned[items]
        src, dst = items[units], targets[units]
        moving = src != dst
        return src[moving], dst[moving]  # ascending, dst >= src

    def owned_after(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        owned = self.owned.copy()
        owned[src] = False
        owned[dst] = True
        return owned

    def apply_moves(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Rewrite the maps after the bytes of `src` were copied to `dst`."""
        if src.size == 0:
            return
        virtual = self.p2v[src]
        self.p2v[src] = -1
        self.owned[src] = False
        self.p2v[dst] = virtual
        self.owned[dst] = True
        self.v2p[virtual] = dst
        self.runs = FreeRuns.from_owned(self.owned)

    # ---- invariants ----------------------------------------------------------------------------
    def check(self, name: str) -> None:
        """Raise InvariantBroken naming the first broken id invariant of this band (`name`)."""
        used_virtual = np.flatnonzero(self.v2p >= 0)
        physical = self.v2p[used_virtual]
        unused = self._unused_virtual[: self._num_unused_virtual]
        require(
            int(self.owned.sum()) == self.num_owned,
            "owned-count",
            "owned count drifted from the free runs",
            name,
        )
        require(self.runs.matches(self.owned), "free-runs", "free runs are the unowned stretches", name)
        require(
            used_virtual.size == self.num_owned,
            "virtual-mapped",
            "every virtual id maps to one physical id",
            name,
        )
        require(
            np.unique(physical).size == physical.size, "physical-once", "no physical id is owned twice", name
        )
        require(bool(self.owned[physical].all()), "mapped-owned", "every mapped physical id is owned", name)
        require(bool((self.p2v[physical] == used_virtual).all()), "p2v-inverts", "p2v inverts v2p", name)
        require(
            bool(((self.p2v >= 0) == self.owned).all()),
            "free-unmapped",
            "free positions map to no virtual id",
            name,
        )
        require(
            np.array_equal(np.sort(unused), np.flatnonzero(self.v2p < 0)),
            "unused-virtual",
            "the unused virtual ids are exactly the unmapped ones",
            name,
        )


def require(ok: bool, code: str, statement: str, subject: str = "") -> None:
    """Raise InvariantBroken(code, statement, subject) unless `ok`."""
    if not ok:
        raise InvariantBroken(code, statement, subject)
