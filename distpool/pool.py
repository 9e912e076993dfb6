"""The interface every pool offers: the unified arena and the static-pool baseline alike.

Callers above the pool (workers, the reference model, the transfer engine) see requests by id and
physical ids only through these calls; the pool alone decides where bytes live.

Contract:
- A *physical page id* indexes dim 0 of `kv_view(layer)`; a *physical slot id* indexes dim 0 of
  every tensor from `state_view(layer)`. They are valid until the next `compact()`; re-read
  `page_ids` / `slot_id` after compaction (the request id never changes).
- `reserve` is all or nothing: a request that does not fit raises `DoesNotFit` and holds nothing.
- `envelope_ranges(request_id)` lists the request's bytes in the arena as `(offset, nbytes)` rows in
  canonical order: the slot first (if the model has one), then each page in token order. Two pools
  with the same layout fingerprint list the same number of rows with the same `nbytes`, which is
  what lets a transfer pair source and destination row by row.
"""

from __future__ import annotations

from typing import Protocol

import torch

from distpool.envelope import Envelope


class DoesNotFit(Exception):
    """A reserve or extend that the pool cannot satisfy now; nothing was taken."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} does not fit: {reason}")
        self.request_id = request_id
        self.reason = reason

    def __reduce__(self):  # crosses Ray's process boundary as itself, so callers can catch it by type
        return type(self), (self.request_id, self.reason)


class Pool(Protocol):
    arena: torch.Tensor  # uint8, 1-D, on the pool's device: every byte the pool owns
    page_size: int
    fingerprint: str

    def can_reserve(self, num_tokens: int) -> bool: ...
    def can_reserve_after_compaction(self, num_tokens: int) -> bool: ...
    def reserve(self, request_id: str, num_tokens: int) -> None: ...
    def extend(self, request_id: str, num_new_tokens: int) -> None: ...
    def release(self, request_id: str) -> None: ...
    # all-or-nothing batch forms: one scan of the free positions per batch, not per request
    def reserve_batch(self, requests: list[tuple[str, int]]) -> None: ...
    def extend_batch(self, requests: list[tuple[str, int]]) -> None: ...
    def release_batch(self, request_ids: list[str]) -> None: ...

    def page_ids(self, request_id: str) -> torch.Tensor: ...  # int64, physical, token order
    def slot_id(self, request_id: str) -> int: ...  # -1 for a model without recurrent state
    def num_tokens(self, request_id: str) -> int: ...

    # (num_pages, page_size, kv_heads, head_dim) each, for full-attention layer `layer`
    def kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    # one (num_slots, *shape) tensor per MambaSpec.tensors entry, for Mamba layer `layer`
    def state_view(self, layer: int) -> tuple[torch.Tensor, ...]: ...

    def envelope(self, request_id: str) -> Envelope: ...
    def envelope_ranges(self, request_id: str) -> torch.Tensor: ...  # (n, 2) int64: offset, nbytes
    def pin(self, request_id: str) -> None: ...
    def unpin(self, request_id: str) -> None: ...
    def compact(self) -> int: ...  # bytes moved

    def stats(self) -> dict[str, int]: ...  # per band: capacity, free, used, reserved (pinned), held
    def check_invariants(self) -> None: ...  # raises AssertionError naming the broken invariant
