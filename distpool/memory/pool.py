"""The interface every pool offers, and its errors (errors.py): the only part of memory that workers see.

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

from typing import TYPE_CHECKING, Protocol

import torch

from distpool.memory.envelope import Envelope
from distpool.memory.errors import (
    BandUsage,
    DoesNotFit,
    DuplicateRequest,
    EnvelopeInvalid,
    HeldPagesInvalid,
    InvariantBroken,
    NeedsCompaction,
    NotALayerOfKind,
    NotPinned,
    RequestIdInvalid,
    RequestPinned,
    TokenCountInvalid,
    UnknownRequest,
)

__all__ = [
    "BandUsage",
    "DoesNotFit",
    "DuplicateRequest",
    "EnvelopeInvalid",
    "HeldPagesInvalid",
    "InvariantBroken",
    "NeedsCompaction",
    "NotALayerOfKind",
    "NotPinned",
    "Pool",
    "RequestIdInvalid",
    "RequestPinned",
    "TokenCountInvalid",
    "UnknownRequest",
]

if TYPE_CHECKING:
    from distpool.memory.prefix import PrefixCache, PrefixMatch


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
    # one (num_slots, *shape) tensor per MambaSpec.tensors entry, for Mamba layer `layer` (strided:
    # a slot interleaves each tensor's rows across layers, memory/sizing/layout.py)
    def state_view(self, layer: int) -> tuple[torch.Tensor, ...]: ...

    def envelope(self, request_id: str, *, held_pages: int = 0) -> Envelope: ...
    def envelope_ranges(self, request_id: str) -> torch.Tensor: ...  # (n, 2) int64: offset, nbytes
    def pin(self, request_id: str) -> None: ...
    def unpin(self, request_id: str) -> None: ...

    def usage(self) -> dict[str, BandUsage]: ...  # per band present: "pages", "slots", "swa_pages"
    def compactions(self) -> tuple[int, int, float]: ...  # so far: count, bytes moved, seconds
    def check_invariants(self) -> None: ...  # raises InvariantBroken (an AssertionError) naming it
