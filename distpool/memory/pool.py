"""The interface every pool offers, and its errors: the only part of memory that workers see.

Callers above the pool (workers, the reference model, the transfer engine) see requests by id and
physical ids only through these calls; the pool alone decides where bytes live.

Contract:
- A *physical page id* indexes dim 0 of `kv_view(layer)`; a *physical slot id* indexes dim 0 of
  every tensor from `state_view(layer)`. They are valid until the next compaction; re-read
  `page_ids` / `slot_id` after one (the request id never changes).
- `slot_id` is None for a model without recurrent state (one sentinel, everywhere).
- `reserve` / `extend` are all or nothing: a request that does not fit raises `DoesNotFit` and holds
  nothing. With `compact=True` the pool compacts first when, and only when, that makes it fit.
- `envelope_ranges(request_id)` lists the request's bytes in `buffer` as `(offset, nbytes)` rows in
  canonical order: the slot first (if the model has one), then each page in token order, then each
  window page. Two pools with the same layout fingerprint list the same number of rows with the
  same `nbytes`, which is what lets a transfer pair source and destination row by row.
  `envelope(request_id)` is those rows as the `Envelope` a transfer moves (envelope.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from distpool.memory.envelope import Envelope

if TYPE_CHECKING:
    from distpool.memory.prefix_cache import PrefixCache
    from distpool.memory.prefix_index import PrefixMatch


class DoesNotFit(Exception):
    """A reserve or extend that the pool cannot satisfy now; nothing was taken."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} does not fit: {reason}")
        self.request_id = request_id
        self.reason = reason

    def __reduce__(self):  # crosses Ray's process boundary as itself, so callers can catch it by type
        return type(self), (self.request_id, self.reason)


class NeedsCompaction(DoesNotFit):
    """Does not fit now, or fits only scattered, and would after a compaction; nothing was taken.
    `low` / `pages`: the low-band units (slots, window pages) and the pages the call needed;
    `window`: the run of free pages it wanted whole (0: any), starting at page position `window_at`
    (-1: anywhere; a position is valid until the next compaction)."""

    def __init__(
        self,
        request_id: str,
        reason: str,
        *,
        low: int = 0,
        pages: int = 0,
        window: int = 0,
        window_at: int = -1,
    ) -> None:
        super().__init__(request_id, reason)
        self.low, self.pages, self.window, self.window_at = low, pages, window, window_at


class UnknownRequest(KeyError):
    """A request id the pool does not hold."""


class DuplicateRequest(ValueError):
    """A reserve of a request id the pool already holds (or that appears twice in one batch)."""


class RequestPinned(ValueError):
    """A release or extend of a request whose envelope a transfer holds (pinned)."""


@dataclass(frozen=True)
class BandUsage:
    """One band's units: `free + held == capacity`; `pinned` of the held units belong to requests a
    transfer holds (they may not move or be released until it concludes); `cached` of them only the
    prefix cache holds (evictable)."""

    capacity: int
    free: int
    held: int
    pinned: int
    cached: int = 0

    @property
    def used(self) -> int:
        """Held by requests no transfer holds."""
        return self.held - self.pinned


class Pool(Protocol):
    buffer: torch.Tensor  # uint8, 1-D, on the pool's device: every byte the pool owns
    page_size: int
    fingerprint: str
    prefix_cache: PrefixCache | None  # cached prefixes by token content (None: caching is off)

    def pages_for(self, num_tokens: int) -> int: ...  # full-attention pages a request of n tokens holds
    def can_reserve(self, num_tokens: int, *, compact: bool = False) -> bool: ...
    # can_reserve, evicting idle cached prefixes while it says no
    def make_room(self, num_tokens: int, *, compact: bool = False) -> bool: ...
    # final_tokens: the length the request expects to reach, so its growth room stays free after it
    # prefix: a `prefix_cache.match(prompt)`: the request's first pages are those cached pages
    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        *,
        compact: bool = False,
        final_tokens: int | None = None,
        prefix: PrefixMatch | None = None,
    ) -> None: ...
    def extend(self, request_id: str, num_new_tokens: int, *, compact: bool = False) -> None: ...
    def release(self, request_id: str) -> None: ...
    # all-or-nothing batch forms: one placement per batch, not per request
    def reserve_batch(
        self, requests: list[tuple[str, int]], *, compact: bool = False, final_tokens: list[int] | None = None
    ) -> None: ...
    def extend_batch(self, requests: list[tuple[str, int]], *, compact: bool = False) -> None: ...
    def release_batch(self, request_ids: list[str]) -> None: ...

    def page_ids(self, request_id: str) -> torch.Tensor: ...  # int64, physical, token order
    def swa_page_ids(self, request_id: str) -> torch.Tensor: ...  # the sliding window's pages, token order
    def swa_first_page(self, request_id: str) -> int: ...  # token-page index of swa_page_ids(...)[0]
    def slot_id(self, request_id: str) -> int | None: ...  # None for a model without recurrent state
    def num_tokens(self, request_id: str) -> int: ...

    # (num_pages, page_size, kv_heads, head_dim) each, for full-attention layer `layer`
    def kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    # the same for sliding-window layer `layer`, indexed by swa page ids
    def swa_kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    # one (num_slots, *shape) tensor per MambaSpec.tensors entry, for Mamba layer `layer`
    def state_view(self, layer: int) -> tuple[torch.Tensor, ...]: ...

    def envelope(self, request_id: str, *, held_pages: int = 0) -> Envelope: ...
    def envelope_ranges(self, request_id: str) -> torch.Tensor: ...  # (n, 2) int64: offset, nbytes
    def pin(self, request_id: str) -> None: ...
    def unpin(self, request_id: str) -> None: ...

    def usage(self) -> dict[str, BandUsage]: ...  # per band present: "pages", "slots", "swa_pages"
    def compactions(self) -> tuple[int, int, float]: ...  # so far: count, bytes moved, seconds
    def check_invariants(self) -> None: ...  # raises AssertionError naming the broken invariant
