"""Ids of one band: which physical positions are owned, and the virtual <-> physical maps.

A band knows nothing of bytes, requests or the other band; the allocator combines two of them.
State (every tensor int64 or bool, length `num_positions`):
- `owned[p]`  — physical position p holds a live unit.
- `p2v[p]`    — the virtual id living at p, or -1 where p is free.
- `v2p[v]`    — the physical position of virtual id v, or -1 where v is unused.
Invariant: v2p and p2v are inverse bijections between used virtual ids and owned positions.
Everything is a tensor op over ids; nothing loops per unit in Python.
"""

from __future__ import annotations

import torch

EMPTY_IDS = torch.empty(0, dtype=torch.int64)


def first_true(mask: torch.Tensor) -> int | None:
    """Index of the first True in a 1-D bool mask, or None."""
    if mask.numel() == 0 or not bool(mask.any()):
        return None
    return int(torch.argmax(mask.to(torch.uint8)))


def last_true(mask: torch.Tensor) -> int | None:
    """Index of the last True in a 1-D bool mask, or None."""
    first_from_end = first_true(mask.flip(0))
    return None if first_from_end is None else mask.numel() - 1 - first_from_end


class Band:
    """Physical positions and virtual ids of `num_positions` fixed-stride units.

    `grows_up`: units are handed out lowest position first (the low band) or highest first (the
    high band), and compaction packs them toward the same end.
    """

    def __init__(self, num_positions: int, *, grows_up: bool) -> None:
        self.num_positions = num_positions
        self.grows_up = grows_up
        self.owned = torch.zeros(num_positions, dtype=torch.bool)
        self.p2v = torch.full((num_positions,), -1, dtype=torch.int64)
        self.v2p = torch.full((num_positions,), -1, dtype=torch.int64)
        self.num_owned = 0

    # ---- choosing positions (pure) -----------------------------------------------------------
    def pick(self, count: int, lo: int, hi: int, owned: torch.Tensor | None = None) -> torch.Tensor | None:
        """`count` free positions in [lo, hi) of `owned` (default: the band's own mask), in hand-out
        order (ascending when growing up, descending when growing down); None if fewer are free."""
        if count == 0:
            return EMPTY_IDS
        owned = self.owned if owned is None else owned
        lo, hi = max(lo, 0), min(hi, self.num_positions)
        if hi - lo < count:
            return None
        free = torch.nonzero(~owned[lo:hi]).flatten() + lo
        if free.numel() < count:
            return None
        return free[:count] if self.grows_up else free[-count:].flip(0)

    def first_owned(self, owned: torch.Tensor | None = None) -> int | None:
        return first_true(self.owned if owned is None else owned)

    def last_owned(self, owned: torch.Tensor | None = None) -> int | None:
        return last_true(self.owned if owned is None else owned)

    # ---- changing ownership ------------------------------------------------------------------
    def assign(self, physical: torch.Tensor) -> torch.Tensor:
        """Own `physical` (free positions) under the lowest unused virtual ids; returns those ids."""
        n = physical.numel()
        if n == 0:
            return EMPTY_IDS
        virtual = torch.nonzero(self.v2p < 0).flatten()[:n]
        assert virtual.numel() == n and not bool(self.owned[physical].any()), "assign over owned positions"
        self.v2p[virtual] = physical
        self.p2v[physical] = virtual
        self.owned[physical] = True
        self.num_owned += n
        return virtual

    def free(self, virtual: torch.Tensor) -> None:
        """Give back the units behind `virtual` (used virtual ids)."""
        if virtual.numel() == 0:
            return
        physical = self.v2p[virtual]
        assert bool((physical >= 0).all()), "free of an unused virtual id"
        self.owned[physical] = False
        self.p2v[physical] = -1
        self.v2p[virtual] = -1
        self.num_owned -= virtual.numel()

    def physical(self, virtual: torch.Tensor) -> torch.Tensor:
        return self.v2p[virtual]

    # ---- compaction ----------------------------------------------------------------------------
    def compaction_moves(self, pinned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) positions that pack the band toward its growing end; `pinned` positions stay.

        Target layout: the pinned units where they are, and the other units on the positions nearest
        the growing end that are not pinned. Units already on a target position stay; every other
        unit moves to a target position that is free now, so no destination is any unit's source.
        """
        movable = self.owned & ~pinned
        num_movable = int(movable.sum())
        candidates = torch.nonzero(~pinned).flatten()  # ascending
        targets = (
            candidates[:num_movable] if self.grows_up else candidates[candidates.numel() - num_movable :]
        )
        target_mask = torch.zeros_like(self.owned)
        target_mask[targets] = True
        src = torch.nonzero(movable & ~target_mask).flatten()
        dst = torch.nonzero(target_mask & ~self.owned).flatten()
        assert src.numel() == dst.numel()
        return src, dst  # both ascending: pairing them keeps the units' relative order

    def owned_after(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        owned = self.owned.clone()
        owned[src] = False
        owned[dst] = True
        return owned

    def apply_moves(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rewrite the maps after the bytes of `src` were copied to `dst`."""
        if src.numel() == 0:
            return
        virtual = self.p2v[src]
        self.p2v[src] = -1
        self.owned[src] = False
        self.p2v[dst] = virtual
        self.owned[dst] = True
        self.v2p[virtual] = dst

    # ---- invariants ----------------------------------------------------------------------------
    def check(self, name: str) -> None:
        """Raise AssertionError naming the first broken id invariant of this band."""
        used_virtual = torch.nonzero(self.v2p >= 0).flatten()
        physical = self.v2p[used_virtual]
        require(int(self.owned.sum()) == self.num_owned, f"{name}: owned count drifted from the counter")
        require(used_virtual.numel() == self.num_owned, f"{name}: every virtual id maps to one physical id")
        require(torch.unique(physical).numel() == physical.numel(), f"{name}: no physical id is owned twice")
        require(bool(self.owned[physical].all()), f"{name}: every mapped physical id is owned")
        require(bool((self.p2v[physical] == used_virtual).all()), f"{name}: p2v inverts v2p")
        require(bool(((self.p2v >= 0) == self.owned).all()), f"{name}: free positions map to no virtual id")


def require(ok: bool, invariant: str) -> None:
    if not ok:
        raise AssertionError(f"invariant broken: {invariant}")
