"""Request-level accounting over the arena's two bands: reserve / extend / release, pins, capacity
queries and compaction plans. Owns ids, the virtual -> physical maps and pins; never touches bytes.

Who owns which token range: a request of `n` tokens holds
- one slot (hybrid Mamba: the low band's unit), whatever `n` is;
- `ceil(n / page_size)` full-attention pages (the high band), page k holding tokens
  [k * page_size, (k + 1) * page_size);
- (hybrid SWA) the sliding-window pages (the low band's units) covering its last `sliding_window`
  tokens; pages whose every token left the window are released as the request grows.
Callers hold request ids; the allocator holds virtual ids per request, so compaction rewrites only
the band maps. Batch calls are all or nothing and loop in Python over requests, never over units.
Where units may go, and how compaction moves them, is the frontier's business (frontier.py).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distpool.memory.arena import BandGeometry
from distpool.memory.band import EMPTY_IDS as _EMPTY
from distpool.memory.band import Band, require
from distpool.memory.frontier import CompactionMoves, Frontier
from distpool.memory.layout import ceil_div
from distpool.memory.pool import (
    BandUsage,
    DoesNotFit,
    DuplicateRequest,
    NeedsCompaction,
    RequestPinned,
    UnknownRequest,
)


@dataclass
class _Holding:
    """What one live request owns, as virtual ids in token order."""

    num_tokens: int
    vslot: torch.Tensor  # 0 or 1 low-band virtual id
    vpages: torch.Tensor  # high-band virtual ids, token order
    vswa: torch.Tensor  # low-band virtual ids of the window's pages, token order: swa_range(num_tokens)
    pins: int = 0


class Allocator:
    """Accounting of one arena. `low` holds slots or sliding-window pages, `high` full pages."""

    def __init__(
        self,
        low: BandGeometry | None,
        high: BandGeometry | None,
        *,
        page_size: int,
        sliding_window: int | None,
        unified: bool,
    ) -> None:
        self.low, self.high = low, high
        self.page_size = page_size
        self.sliding_window = sliding_window
        self.unified = unified
        self.low_band = Band(low.num_positions, grows_up=True) if low else Band(0, grows_up=True)
        self.high_band = Band(high.num_positions, grows_up=False) if high else Band(0, grows_up=False)
        self.has_slot = low is not None and low.name == "slots"
        self.has_swa = low is not None and low.name == "swa_pages"
        self.frontier = Frontier(low, high, self.low_band, self.high_band, unified=unified)
        self.holdings: dict[str, _Holding] = {}

    # ---- what a request of n tokens holds ----------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.page_size) if self.high else 0

    def swa_range(self, num_tokens: int) -> tuple[int, int]:
        """Token-page indices [first, end) of the window's pages (the last `sliding_window` tokens)."""
        if not self.has_swa:
            return 0, 0
        kept_from = max(0, num_tokens - self.sliding_window) if self.sliding_window else 0
        return kept_from // self.page_size, ceil_div(num_tokens, self.page_size)

    def low_units_for(self, num_tokens: int) -> int:
        first, end = self.swa_range(num_tokens)
        return int(self.has_slot) + end - first

    def _compacted_masks(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Ownership masks as they would be after compaction (None, None: as they are)."""
        if not self.unified:
            return None, None
        return self.frontier.owned_after(self.compaction_moves())

    # ---- capacity ------------------------------------------------------------------------------
    def available(self, *, after_compaction: bool = False) -> tuple[int, int]:
        """(low units, pages) that could be handed out now (or after `compact()`). Each figure counts
        the shared gap between the bands, so both cannot be taken at once."""
        return self.frontier.available(*(self._compacted_masks() if after_compaction else (None, None)))

    def can_reserve(self, num_tokens: int, *, after_compaction: bool = False) -> bool:
        masks = self._compacted_masks() if after_compaction else (None, None)
        return (
            self.frontier.fit(self.low_units_for(num_tokens), self.pages_for(num_tokens), *masks) is not None
        )

    def _refuse(self, request_ids: list[str], low_count: int, high_count: int) -> DoesNotFit:
        low_now, high_now = self.available()
        low_name = self.low.name if self.low else "slots"
        reason = (
            f"{len(request_ids)} request(s) need {low_count} {low_name} and {high_count} pages; available "
            f"now: {low_now} {low_name}, {high_now} pages"
        )
        if self.unified and self.frontier.fit(low_count, high_count, *self._compacted_masks()) is not None:
            return NeedsCompaction(request_ids[0], reason + "; compaction would make room: call compact()")
        pinned = sum(1 for h in self.holdings.values() if h.pins)
        return DoesNotFit(request_ids[0], reason + f" ({len(self.holdings)} live requests, {pinned} pinned)")

    # ---- reserve / extend / release ------------------------------------------------------------
    def _holding(self, request_id: str) -> _Holding:
        try:
            return self.holdings[request_id]
        except KeyError:
            raise UnknownRequest(f"unknown request {request_id!r}") from None

    @staticmethod
    def _check_batch(requests: Sequence[tuple[str, int]], what: str) -> list[tuple[str, int]]:
        """The batch with plain-int token counts; raises before anything changes."""
        ids = [rid for rid, _ in requests]
        if len(set(ids)) != len(ids):
            raise DuplicateRequest(f"{what}: a request id appears twice in one batch: {ids}")
        checked = []
        for rid, n in requests:
            if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 0:
                raise ValueError(f"{what} {rid!r}: token count must be a non-negative int; got {n!r}")
            checked.append((rid, int(n)))
        return checked

    def reserve_batch(self, requests: Sequence[tuple[str, int]]) -> None:
        """Reserve each (request_id, num_tokens): its slot and pages. All or nothing."""
        requests = self._check_batch(requests, "reserve")
        ids = [rid for rid, _ in requests]
        for rid in ids:
            if rid in self.holdings:
                raise DuplicateRequest(f"reserve: request {rid!r} is already reserved")
        low_counts = [self.low_units_for(n) for _, n in requests]
        high_counts = [self.pages_for(n) for _, n in requests]
        fit = self.frontier.fit(sum(low_counts), sum(high_counts))
        if fit is None:
            raise self._refuse(ids, sum(low_counts), sum(high_counts))
        low_chunks = torch.split(self.low_band.assign(fit[0]), low_counts)
        # Pages come highest first; each request's own pages run ascending in token order.
        high_chunks = torch.split(self.high_band.assign(fit[1]), high_counts)
        for (rid, n), low_v, high_v in zip(requests, low_chunks, high_chunks, strict=True):
            slots = int(self.has_slot)
            self.holdings[rid] = _Holding(
                num_tokens=n,
                vslot=low_v[:slots],
                vpages=high_v.flip(0),
                vswa=low_v[slots:],
            )

    def extend_batch(self, requests: Sequence[tuple[str, int]]) -> None:
        """Grow each (request_id, num_new_tokens); releases sliding-window pages that left the
        window. All or nothing."""
        requests = self._check_batch(requests, "extend")
        ids = [rid for rid, _ in requests]
        holdings = [self._holding(rid) for rid in ids]
        for rid, h in zip(ids, holdings, strict=True):
            if h.pins:
                raise RequestPinned(f"extend: request {rid!r} is pinned by a transfer; unpin it first")
        new_pages, new_swa, drops = [], [], []
        for (_, k), h in zip(requests, holdings, strict=True):
            total = h.num_tokens + k
            new_pages.append(self.pages_for(total) - h.vpages.numel())
            held_first, held_end = self.swa_range(h.num_tokens)  # the window only moves forward
            first, end = self.swa_range(total)
            new_swa.append(max(end - max(held_end, first), 0))
            drops.append(min(max(first - held_first, 0), h.vswa.numel()))
        released = torch.cat([h.vswa[:d] for h, d in zip(holdings, drops, strict=True)] + [_EMPTY])
        low_owned = None
        if released.numel():  # fit as if the dropped window pages were already free
            low_owned = self.low_band.owned.clone()
            low_owned[self.low_band.physical(released)] = False
        fit = self.frontier.fit(sum(new_swa), sum(new_pages), low_owned=low_owned)
        if fit is None:
            raise self._refuse(ids, sum(new_swa), sum(new_pages))
        self.low_band.free(released)
        swa_chunks = torch.split(self.low_band.assign(fit[0]), new_swa)
        page_chunks = torch.split(self.high_band.assign(fit[1]), new_pages)
        for (_, k), h, d, swa_v, page_v in zip(
            requests, holdings, drops, swa_chunks, page_chunks, strict=True
        ):
            h.num_tokens += k
            if page_v.numel():  # most decode steps cross no page boundary: no copy then
                h.vpages = torch.cat([h.vpages, page_v.flip(0)])
            if d or swa_v.numel():
                h.vswa = torch.cat([h.vswa[d:], swa_v])

    def release_batch(self, request_ids: Sequence[str]) -> None:
        """Free everything the requests hold. All or nothing (unknown or pinned ids free nothing)."""
        if len(set(request_ids)) != len(request_ids):
            raise DuplicateRequest(f"release: a request id appears twice in one batch: {list(request_ids)}")
        holdings = [self._holding(rid) for rid in request_ids]
        for rid, h in zip(request_ids, holdings, strict=True):
            if h.pins:
                raise RequestPinned(f"release: request {rid!r} is pinned by a transfer; unpin it first")
        self.low_band.free(torch.cat([t for h in holdings for t in (h.vslot, h.vswa)] + [_EMPTY]))
        self.high_band.free(torch.cat([h.vpages for h in holdings] + [_EMPTY]))
        for rid in request_ids:
            del self.holdings[rid]

    def pin(self, request_id: str) -> None:
        """Forbid moving (and releasing or extending) the request's envelope; pins nest."""
        self._holding(request_id).pins += 1

    def unpin(self, request_id: str) -> None:
        h = self._holding(request_id)
        if h.pins == 0:
            raise ValueError(f"unpin: request {request_id!r} is not pinned")
        h.pins -= 1

    # ---- physical ids --------------------------------------------------------------------------
    def page_ids(self, request_id: str) -> torch.Tensor:
        return self.high_band.physical(self._holding(request_id).vpages)

    def swa_page_ids(self, request_id: str) -> torch.Tensor:
        return self.low_band.physical(self._holding(request_id).vswa)

    def num_tokens(self, request_id: str) -> int:
        return self._holding(request_id).num_tokens

    def swa_first_page(self, request_id: str) -> int:
        return self.swa_range(self._holding(request_id).num_tokens)[0]

    def slot_id(self, request_id: str) -> int | None:
        vslot = self._holding(request_id).vslot
        return int(self.low_band.physical(vslot)[0]) if vslot.numel() else None

    # ---- compaction ----------------------------------------------------------------------------
    def _pinned_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        low = torch.zeros_like(self.low_band.owned)
        high = torch.zeros_like(self.high_band.owned)
        for h in self.holdings.values():
            if h.pins:
                low[self.low_band.physical(torch.cat([h.vslot, h.vswa]))] = True
                high[self.high_band.physical(h.vpages)] = True
        return low, high

    def compaction_moves(self) -> CompactionMoves:
        """Moves that pack both bands around pinned requests (none for a static pool). Pure."""
        return self.frontier.compaction_moves(*self._pinned_masks())

    def apply_compaction(self, moves: CompactionMoves) -> None:
        """Rewrite the maps once the moves' bytes have been copied."""
        self.frontier.apply(moves)

    # ---- accounting ----------------------------------------------------------------------------
    def usage(self) -> dict[str, BandUsage]:
        """Per band present ("pages", "slots" or "swa_pages"): capacity, free, held, pinned."""
        out: dict[str, BandUsage] = {}
        for geometry, band, parts in (
            (self.high, self.high_band, ("vpages",)),
            (self.low, self.low_band, ("vslot", "vswa")),
        ):
            if geometry is None:
                continue
            held = pinned = 0
            for h in self.holdings.values():
                units = sum(getattr(h, p).numel() for p in parts)
                held += units
                pinned += units if h.pins else 0
            free = band.num_positions - band.num_owned
            out[geometry.name] = BandUsage(capacity=band.num_positions, free=free, held=held, pinned=pinned)
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError naming the broken invariant (see `BandUsage` for the counts)."""
        self.low_band.check("low band")
        self.high_band.check("high band")
        for name, u in self.usage().items():
            require(u.free + u.held == u.capacity, f"{name}: free + held == capacity")
            require(0 <= u.pinned <= u.held, f"{name}: pinned units are held units")
        for band, parts in ((self.low_band, ("vslot", "vswa")), (self.high_band, ("vpages",))):
            ids = torch.cat([getattr(h, p) for h in self.holdings.values() for p in parts] + [_EMPTY])
            require(torch.unique(ids).numel() == ids.numel(), "no virtual id is held by two requests")
            require(ids.numel() == band.num_owned, "every owned unit belongs to a live request")
            require(bool((band.physical(ids) >= 0).all()), "every held virtual id maps to a physical id")
        for rid, h in self.holdings.items():
            first, end = self.swa_range(h.num_tokens)
            require(h.pins >= 0, f"{rid}: pin count is non-negative")
            require(h.vpages.numel() == self.pages_for(h.num_tokens), f"{rid}: one page per page_size tokens")
            require(h.vslot.numel() == int(self.has_slot), f"{rid}: one slot per request")
            require(h.vswa.numel() == end - first, f"{rid}: window pages cover the window")
        require(not self.frontier.bands_overlap(), "low and high band units never overlap in bytes")
