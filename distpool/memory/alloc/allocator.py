"""Request-level accounting over the arena's two bands: reserve / extend / release, pins, capacity
queries and compaction plans. Owns ids, the virtual -> physical maps and pins; never touches bytes.

What a request of n tokens holds is footprint.py's contract.
Callers hold request ids; the allocator holds virtual ids per request (requests.py), so compaction
rewrites only the band maps. Batch calls are all or nothing; their cost grows with the requests and
the free runs they touch, never with the positions of a band. A decode step touches the bands only
for requests that cross a page boundary: the others cost a few array operations for the whole batch.
The allocator composes its parts, each with its own state: the two bands' ids (band.py), how much
fits (the frontier, frontier.py), which positions new units take (placement.py, over each band's
free runs), the growth room each request expects (claims.py), pages with several holders and the
cache's own units (the shared-page table, sharing.py), compaction plans (compaction.py) and the
growth of live requests (growth.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from distpool.memory.alloc.claims import GrowthClaims
from distpool.memory.alloc.compaction import CompactionPlanner
from distpool.memory.alloc.footprint import Footprint
from distpool.memory.alloc.growth import Growth
from distpool.memory.alloc.move_cost import MoveCost
from distpool.memory.alloc.placement import GAP_KEEP_LOW_UNITS, Placement
from distpool.memory.alloc.requests import RequestTable, checked_batch, concat_ids, repeated
from distpool.memory.alloc.sharing import SharedPages
from distpool.memory.arena import Band, BandGeometry, CompactionMoves, Frontier, require
from distpool.memory.errors import BandUsage, DoesNotFit, DuplicateRequest, NeedsCompaction
from distpool.memory.sizing import ceil_div


class Allocator:
    """Accounting of one arena. `low` holds slots or sliding-window pages, `high` full pages.

    `placement`: "extent" (each request's pages in as few ascending runs as possible) or
    "first_fit" (the highest free pages one by one: the baseline); see placement.py.
    """

    def __init__(
        self,
        low: BandGeometry | None,
        high: BandGeometry | None,
        *,
        page_size: int,
        sliding_window: int | None,
        unified: bool,
        placement: str = "extent",
    ) -> None:
        self.low, self.high = low, high
        self.unified = unified
        self.low_band = Band(low.num_positions, grows_up=True) if low else Band(0, grows_up=True)
        self.high_band = Band(high.num_positions, grows_up=False) if high else Band(0, grows_up=False)
        self.has_slot = low is not None and low.name == "slots"
        self.has_swa = low is not None and low.name == "swa_pages"
        self.footprint = Footprint(
            page_size=page_size,
            sliding_window=sliding_window,
            has_pages=high is not None,
            has_slot=self.has_slot,
            has_swa=self.has_swa,
        )
        self.frontier = Frontier(low, high, self.low_band, self.high_band, unified=unified)
        gap_keep = GAP_KEEP_LOW_UNITS * ceil_div(low.stride_bytes, high.stride_bytes) if low and high else 0
        self.placement = Placement(self.low_band, self.high_band, mode=placement, gap_keep=gap_keep)
        self.holdings = RequestTable()
        self.claims = GrowthClaims(self.high_band, self.holdings)
        self.sharing = SharedPages(self.low_band, self.high_band, self.holdings)
        cost = MoveCost(page_bytes=high.stride_bytes if high else 0)
        self.planner = CompactionPlanner(
            self.frontier, self.placement, self.holdings, self.claims, self.sharing, cost
        )
        self.growth = Growth(
            self.footprint, self.holdings, self.frontier, self.placement, self.claims, self.planner
        )

    # ---- what a request of n tokens holds (footprint.py) ---------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return self.footprint.pages_for(num_tokens)

    def swa_range(self, num_tokens: int) -> tuple[int, int]:
        return self.footprint.swa_range(num_tokens)

    def low_units_for(self, num_tokens: int) -> int:
        return self.footprint.low_units_for(num_tokens)

    # ---- capacity ------------------------------------------------------------------------------
    def available(self, *, after_compaction: bool = False) -> tuple[int, int]:
        """(low units, pages) that could be handed out now (or after `compact()`). Each figure counts
        the shared gap between the bands, so both cannot be taken at once."""
        runs = self.planner.runs_after_compaction() if after_compaction else (None, None)
        return self.frontier.available(*runs)

    def can_reserve(self, num_tokens: int, *, after_compaction: bool = False) -> bool:
        runs = self.planner.runs_after_compaction() if after_compaction else (None, None)
        return self.frontier.fits(self.low_units_for(num_tokens), self.pages_for(num_tokens), *runs)

    # ---- reserve / extend / release ------------------------------------------------------------
    def reserve_batch(
        self,
        requests: Sequence[tuple[str, int]],
        final_tokens: Sequence[int] | None = None,
        *,
        prefer_compaction: bool = False,
        prefixes: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Reserve each (request_id, num_tokens): its slot and pages. All or nothing.

        final_tokens[i] (optional): the length request i expects to reach; the pages it will grow
        by are kept free after its own where the placement can (a hint: nothing is held for them).
        prefer_compaction: raise NeedsCompaction, taking nothing, when the batch's largest request
        would scatter over several free runs but a compaction that keeps every request's growth
        room would gather enough free pages into the gap between the bands.
        prefixes[i] (optional): request i's first pages, held by the prefix cache (sharing.py)."""
        ids, array = checked_batch(requests, "reserve")
        for rid in ids:
            if rid in self.holdings:
                raise DuplicateRequest("reserve", rid, in_batch=False)
        counts = array.tolist()
        rooms = self.footprint.growth_pages(ids, counts, final_tokens)
        shared = self.sharing.checked_prefixes(prefixes, counts, self.footprint.page_size)
        low_counts = [self.low_units_for(n) for n in counts]
        high_counts = [self.pages_for(n) - len(prefix) for n, prefix in zip(counts, shared, strict=True)]
        if not self.frontier.fits(sum(low_counts), sum(high_counts)):
            raise self.planner.refusal(ids, sum(low_counts), sum(high_counts))
        if prefer_compaction and self.planner.window_pays(high_counts, rooms, sum(low_counts)):
            raise NeedsCompaction(
                ids[0],
                "no free run holds its pages whole; clearing one costs less than the scatter",
                low=sum(low_counts),
                pages=sum(high_counts),
                window=max(high_counts),
            )
        low_pos = self.placement.low_positions(sum(low_counts))
        floor = self.frontier.high_floor(extra_low_top=int(low_pos[-1]) if low_pos.size else -1)
        low_v = self.low_band.assign(low_pos).tolist()
        high_pos = self.placement.page_positions(high_counts, floor, rooms, self.claims.live())
        high_v = self.high_band.assign(high_pos).tolist()
        low_at = high_at = 0
        slots = int(self.has_slot)
        for rid, n, nl, nh, prefix in zip(ids, counts, low_counts, high_counts, shared, strict=True):
            vslot = low_v[low_at] if slots else -1
            vswa = low_v[low_at + slots : low_at + nl]
            self.holdings.add(rid, n, vslot, prefix + high_v[high_at : high_at + nh], vswa)
            low_at, high_at = low_at + nl, high_at + nh
        if prefixes is not None:
            self.sharing.share(concat_ids(shared))
        if any(rooms):
            rows = np.fromiter((self.holdings.rows[rid] for rid in ids), dtype=np.int64, count=len(ids))
            self.holdings.room[rows] = rooms
            self.claims.set(rows)

    def extend_batch(self, requests: Sequence[tuple[str, int]], *, prefer_compaction: bool = False) -> None:
        """Grow each (request_id, num_new_tokens); releases sliding-window pages that left the
        window. All or nothing. Requests that cross no page boundary touch no band.
        prefer_compaction: raise NeedsCompaction, taking nothing, when the one request growing
        elsewhere by several pages would scatter them and clearing one free run for them costs
        less (`CompactionPlanner.growth_window`)."""
        self.growth.extend_batch(requests, prefer_compaction=prefer_compaction)

    def release_batch(self, request_ids: Sequence[str]) -> None:
        """Free everything the requests hold. All or nothing (unknown or pinned ids free nothing)."""
        if len(set(request_ids)) != len(request_ids):
            raise DuplicateRequest("release", repeated(request_ids), in_batch=True)
        if not request_ids:
            return
        rows = self.holdings.unpinned_rows(request_ids, "release")
        self.claims.clear(rows)
        low_ids, high_ids = self.holdings.held_ids(rows)
        self.low_band.free(low_ids)
        self.high_band.free(self.sharing.let_go(high_ids))
        self.holdings.remove(request_ids)

    def pin(self, request_id: str) -> None:
        """Forbid moving (and releasing or extending) the request's envelope; pins nest."""
        self.holdings.pin(request_id)

    def unpin(self, request_id: str) -> None:
        self.holdings.unpin(request_id)

    # ---- physical ids --------------------------------------------------------------------------
    def page_ids(self, request_id: str) -> torch.Tensor:
        vpages = np.array(self.holdings.vpages[self.holdings.row(request_id)], dtype=np.int64)
        return torch.from_numpy(self.high_band.physical(vpages))

    def swa_page_ids(self, request_id: str) -> torch.Tensor:
        vswa = np.array(self.holdings.vswa[self.holdings.row(request_id)], dtype=np.int64)
        return torch.from_numpy(self.low_band.physical(vswa))

    def num_tokens(self, request_id: str) -> int:
        return int(self.holdings.num_tokens[self.holdings.row(request_id)])

    def swa_first_page(self, request_id: str) -> int:
        return self.swa_range(self.num_tokens(request_id))[0]

    def slot_id(self, request_id: str) -> int | None:
        vslot = int(self.holdings.vslot[self.holdings.row(request_id)])
        return int(self.low_band.v2p[vslot]) if vslot >= 0 else None

    # ---- the prefix cache's holds and units (sharing.py) ----------------------------------------
    @property
    def cached(self) -> np.ndarray:
        """Per high-band virtual id: whether the prefix cache holds the page."""
        return self.sharing.cached

    @property
    def checkpoint(self) -> np.ndarray:
        """Per low-band virtual id: whether the unit is one of the cache's checkpoints."""
        return self.sharing.checkpoint

    def hold_pages(self, vpages: Sequence[int]) -> None:
        """The cache takes a hold on live pages (each at most once)."""
        self.sharing.hold(np.asarray(vpages, dtype=np.int64))

    def drop_pages(self, vpages: Sequence[int]) -> None:
        """The cache lets go of pages it holds; a page nobody else holds is freed."""
        self.high_band.free(self.sharing.drop(np.asarray(vpages, dtype=np.int64)))

    def take_checkpoints(self, count: int) -> np.ndarray:
        """`count` low-band units for the cache (placed like slots); raises DoesNotFit."""
        if not self.frontier.fits(count, 0):
            raise DoesNotFit("checkpoint", f"no room for {count} checkpoint(s) in the low band")
        vids = self.low_band.assign(self.placement.low_positions(count))
        self.sharing.adopt_checkpoints(vids)
        return vids

    def drop_checkpoints(self, vids: Sequence[int]) -> None:
        vids = np.asarray(vids, dtype=np.int64)
        self.sharing.release_checkpoints(vids)
        self.low_band.free(vids)

    def checkpoint_slot_id(self, vid: int) -> int:
        """Physical slot id of checkpoint `vid` (valid until the next compaction)."""
        return self.sharing.checkpoint_slot_id(vid)

    # ---- compaction (plans: compaction.py) -----------------------------------------------------
    def compaction_moves(
        self, *, keep_room: bool = False, need: NeedsCompaction | None = None
    ) -> CompactionMoves:
        """See `CompactionPlanner.compaction_moves`."""
        return self.planner.compaction_moves(keep_room=keep_room, need=need)

    def apply_compaction(self, moves: CompactionMoves) -> None:
        """Rewrite the maps once the moves' bytes have been copied."""
        self.frontier.apply(moves)
        self.claims.reset()

    # ---- accounting ----------------------------------------------------------------------------
    def usage(self) -> dict[str, BandUsage]:
        """Per band present ("pages", "slots" or "swa_pages"): capacity, free, held, pinned and
        cached (held by the prefix cache alone). A shared page counts once."""
        pinned = self.holdings.held_ids(np.array(self.holdings.pinned_rows(), dtype=np.int64))
        cached = self.sharing.cached_only()
        out: dict[str, BandUsage] = {}
        for i, geometry, band in ((1, self.high, self.high_band), (0, self.low, self.low_band)):
            if geometry is not None:
                out[geometry.name] = BandUsage(
                    capacity=band.num_positions,
                    free=band.num_positions - band.num_owned,
                    held=band.num_owned,
                    pinned=int(np.unique(pinned[i]).size),
                    cached=cached[i],
                )
        return out

    def check_invariants(self) -> None:
        """Raise InvariantBroken naming the broken invariant (see `BandUsage` for the counts)."""
        self.low_band.check("low band")
        self.high_band.check("high band")
        for name, u in self.usage().items():
            require(u.free + u.held == u.capacity, "usage-adds-up", "free + held == capacity", name)
            require(0 <= u.pinned <= u.held, "pinned-held", "pinned units are held units", name)
        table = self.holdings
        for band, ids in zip((self.low_band, self.high_band), table.held_ids(table.live_rows()), strict=True):
            require(
                bool((band.physical(ids) >= 0).all()),
                "held-mapped",
                "every held virtual id maps to a physical id",
            )
        self.sharing.check()
        table.check(require)
        self.claims.check()
        self.footprint.check(table)
        require(
            not self.frontier.bands_overlap(), "bands-apart", "low and high band units never overlap in bytes"
        )
