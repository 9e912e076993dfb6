"""The shared-page table: pages with several holders (prefix caching), and the cache's own low units.

A full page may be held by several requests and by the prefix cache at once: a full page is never
written again, so sharing needs no copy. `extra_holders[v]` counts the holders of high-band virtual
id v beyond the first; a page is freed when its last holder lets go. Pages become shared only
through `reserve_batch(..., prefixes=...)` (a request starts with pages the cache holds) and
`hold_pages` (the cache adopts a request's pages). Until then `num_shared` is 0 and releasing costs
what it always did.

The cache also owns low-band units of its own: state checkpoints, one slot-sized copy of the
recurrent state each (`take_checkpoints` / `drop_checkpoints`), placed like slots.

    request a: [p0 p1 p2 p3]        extra_holders: p0, p1 -> 2 (a, b and the cache)
    request b: [p0 p1 p7]                          p2 -> 1 (a and the cache)
    cache:     [p0 p1 p2] + a checkpoint after p1
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distpool.memory.alloc.requests import RequestTable
from distpool.memory.arena import Band, require


class SharedPages:
    """Who holds the pages of `high_band` beyond their first holder, and which units of `low_band`
    the cache owns. Reads the bands and the request table; changes only its own arrays (the
    allocator assigns and frees the units)."""

    def __init__(self, low_band: Band, high_band: Band, table: RequestTable) -> None:
        self.low_band, self.high_band, self.table = low_band, high_band, table
        self.extra_holders = np.zeros(high_band.num_positions, dtype=np.int64)
        self.num_shared = 0  # virtual ids with extra holders
        self.cached = np.zeros(high_band.num_positions, dtype=bool)  # pages the cache holds
        self.checkpoint = np.zeros(low_band.num_positions, dtype=bool)  # low units the cache owns

    # ---- holds on pages ----------------------------------------------------------------------
    def hold(self, vids: np.ndarray) -> None:
        """The cache takes a hold on live pages (each at most once)."""
        if not vids.size:
            return
        if not bool((self.high_band.v2p[vids] >= 0).all()) or self.cached[vids].any():
            raise ValueError("hold_pages: the cache holds only live pages, each once")
        self.cached[vids] = True
        self.share(vids)

    def drop(self, vids: np.ndarray) -> np.ndarray:
        """The cache lets go of pages it holds; returns those nobody holds any more."""
        if not bool(self.cached[vids].all()):
            raise ValueError("drop_pages: the cache does not hold every one of these pages")
        self.cached[vids] = False
        return self.let_go(vids)

    def share(self, vids: np.ndarray) -> None:
        """One more holder for each of `vids` (duplicates: one per occurrence). O(len(vids))."""
        unique, counts = np.unique(vids, return_counts=True)
        self.num_shared += int(np.count_nonzero(self.extra_holders[unique] == 0))
        self.extra_holders[unique] += counts

    def let_go(self, vids: np.ndarray) -> np.ndarray:
        """One holder less for each of `vids` (duplicates: one per occurrence); returns the pages
        whose last holder left (the caller frees them)."""
        if not vids.size or not self.num_shared:  # nothing is shared: every page has one holder
            return vids
        unique, counts = np.unique(vids, return_counts=True)
        shared_before = self.extra_holders[unique] > 0
        left = self.extra_holders[unique] + 1 - counts  # holders afterwards
        if (left < 0).any():
            raise ValueError(f"pages {unique[left < 0].tolist()} let go of more often than they were held")
        self.extra_holders[unique] = np.maximum(left - 1, 0)
        self.num_shared -= int(np.count_nonzero(shared_before & (left <= 1)))
        return unique[left == 0]

    def checked_prefixes(
        self, prefixes: Sequence[Sequence[int]] | None, counts: list[int], page_size: int
    ) -> list[list[int]]:
        """Each reserved request's shared prefix (virtual page ids, token order), checked: pages the
        cache holds, covering fewer tokens than the request (it computes at least its last one)."""
        if prefixes is None:
            return [[] for _ in counts]
        if len(prefixes) != len(counts):
            raise ValueError(f"reserve: {len(prefixes)} prefixes for {len(counts)} requests")
        out = [[int(v) for v in prefix] for prefix in prefixes]
        for prefix, n in zip(out, counts, strict=True):
            vids = np.asarray(prefix, dtype=np.int64)
            if len(prefix) * page_size >= max(n, 1) or (vids.size and not bool(self.cached[vids].all())):
                raise ValueError(
                    f"reserve: a prefix of {len(prefix)} pages for {n} tokens: a prefix holds pages the "
                    "prefix cache holds and covers fewer tokens than the request"
                )
        return out

    # ---- checkpoints -------------------------------------------------------------------------
    def adopt_checkpoints(self, vids: np.ndarray) -> None:
        """Low units just assigned to the cache."""
        self.checkpoint[vids] = True

    def release_checkpoints(self, vids: np.ndarray) -> None:
        """The cache gives up checkpoints `vids` (the caller frees the units)."""
        if not bool(self.checkpoint[vids].all()):
            raise ValueError("drop_checkpoints: not every one of these units is a checkpoint")
        self.checkpoint[vids] = False

    def checkpoint_slot_id(self, vid: int) -> int:
        """Physical slot id of checkpoint `vid` (valid until the next compaction)."""
        if not self.checkpoint[vid]:
            raise ValueError(f"{vid} is not a checkpoint")
        return int(self.low_band.v2p[vid])

    # ---- planning and accounting -------------------------------------------------------------
    def holder_groups(self, rows: np.ndarray) -> tuple[list[np.ndarray], list[int]]:
        """Physical pages per holder for compaction plans, each page in one group only: each
        request's pages not listed yet (token order), then the pages only the cache holds, one
        group per physically contiguous stretch. Returns (groups, growth room per group)."""
        table = self.table
        groups, rooms, seen = [], [], np.zeros(self.high_band.num_positions, dtype=bool)
        for r in rows.tolist():
            vids = np.array(table.vpages[r], dtype=np.int64)
            if self.num_shared:
                vids = vids[~seen[vids]]
                seen[vids] = True
            groups.append(self.high_band.physical(vids))
            rooms.append(int(table.room[r]))
        alone = np.flatnonzero(self.cached & ~seen & (self.high_band.v2p >= 0)) if self.cached.any() else []
        if len(alone):
            physical = np.sort(self.high_band.physical(alone))
            for stretch in np.split(physical, np.flatnonzero(np.diff(physical) != 1) + 1):
                groups.append(stretch)
                rooms.append(0)
        return groups, rooms

    def cached_only(self) -> tuple[int, int]:
        """(low units, pages) that only the cache holds: reclaimable by eviction."""
        pages = int(np.count_nonzero(self.cached & (self.extra_holders == 0)))
        return int(np.count_nonzero(self.checkpoint)), pages

    def check(self) -> None:
        table = self.table
        low_ids, high_ids = table.held_ids(table.live_rows())
        holders = np.bincount(high_ids, minlength=self.high_band.num_positions)
        holders += self.cached
        owned = self.high_band.v2p >= 0
        require(
            bool((holders[owned] == self.extra_holders[owned] + 1).all()),
            "page-holders",
            "each page's holders are counted",
        )
        require(
            not bool(holders[~owned].any()) and not self.extra_holders[~owned].any(),
            "free-unheld",
            "no free page is held",
        )
        require(
            self.num_shared == int(np.count_nonzero(self.extra_holders)),
            "shared-count",
            "the shared-page count matches",
        )
        checkpoints = np.flatnonzero(self.checkpoint)
        require(np.unique(low_ids).size == low_ids.size, "low-once", "no low unit is held by two requests")
        require(
            not np.isin(low_ids, checkpoints).any(), "checkpoint-unheld", "no checkpoint is a request's unit"
        )
        require(
            low_ids.size + checkpoints.size == self.low_band.num_owned,
            "low-held",
            "every low unit has its holder",
        )
        require(
            bool((self.low_band.v2p[checkpoints] >= 0).all()), "checkpoint-live", "every checkpoint is live"
        )
