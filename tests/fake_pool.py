"""A minimal pool over plain tensors, for model tests that must not depend on the arena.

It implements the part of the `Pool` protocol a model uses (reserve / extend(_batch) / release, page and
slot ids, `kv_view`, `state_view`) with separate K, V and state tensors per layer and simple free
lists. Fresh and freed memory is NaN, so a model that reads a row it never wrote produces NaN logits
instead of plausible tokens. `shuffle` moves every page and slot to a new physical position and
remaps the ids, as compaction does.
"""

from __future__ import annotations

import math

import torch

from distpool.memory.pool import DoesNotFit
from distpool.model.dtypes import torch_dtype
from distpool.model.spec import ModelSpec


class FakePool:
    def __init__(
        self, spec: ModelSpec, *, page_size: int, num_pages: int, num_slots: int, device: str = "cpu"
    ) -> None:
        assert spec.full_attention is not None and spec.mamba is not None
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        attention = spec.full_attention
        kv_shape = (num_pages, page_size, attention.num_kv_heads, attention.head_dim)
        kv_dtype = torch_dtype(attention.dtype)
        self._kv = {
            layer: (
                torch.full(kv_shape, math.nan, dtype=kv_dtype, device=device),
                torch.full(kv_shape, math.nan, dtype=kv_dtype, device=device),
            )
            for layer in spec.full_attention_layers
        }
        self._states = {
            layer: tuple(
                torch.full((num_slots, *t.shape), math.nan, dtype=torch_dtype(t.dtype), device=device)
                for t in spec.mamba.tensors
            )
            for layer in spec.mamba_layers
        }
        self.free_pages: list[int] = list(range(num_pages))
        self.free_slots: list[int] = list(range(num_slots))
        self._pages: dict[str, list[int]] = {}
        self._slot: dict[str, int] = {}
        self._tokens: dict[str, int] = {}

    # ---- ownership ---------------------------------------------------------------------------
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_reserve(self, num_tokens: int) -> bool:
        return bool(self.free_slots) and self._pages_for(num_tokens) <= len(self.free_pages)

    def reserve(self, request_id: str, num_tokens: int) -> None:
        assert request_id not in self._tokens, f"{request_id} reserved twice"
        if not self.can_reserve(num_tokens):
            raise DoesNotFit(
                request_id, f"{num_tokens} tokens need a slot and {self._pages_for(num_tokens)} pages"
            )
        num_pages = self._pages_for(num_tokens)
        self._pages[request_id], self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        self._slot[request_id] = self.free_slots.pop(0)
        self._tokens[request_id] = num_tokens

    def extend(self, request_id: str, num_new_tokens: int) -> None:
        num_tokens = self._tokens[request_id] + num_new_tokens
        more = self._pages_for(num_tokens) - len(self._pages[request_id])
        if more > len(self.free_pages):
            raise DoesNotFit(request_id, f"{more} more pages, {len(self.free_pages)} free")
        self._pages[request_id] += self.free_pages[:more]
        self.free_pages = self.free_pages[more:]
        self._tokens[request_id] = num_tokens

    def extend_batch(self, requests: list[tuple[str, int]]) -> None:
        """Grow every (request_id, num_new_tokens), all or nothing."""
        more = sum(self._pages_for(self._tokens[r] + n) - len(self._pages[r]) for r, n in requests)
        if more > len(self.free_pages):
            raise DoesNotFit(requests[0][0], f"{more} more pages for the batch, {len(self.free_pages)} free")
        for request_id, num_new_tokens in requests:
            self.extend(request_id, num_new_tokens)

    def release(self, request_id: str) -> None:
        pages = self._pages.pop(request_id)
        slot = self._slot.pop(request_id)
        del self._tokens[request_id]
        for k, v in self._kv.values():  # poison: a later owner must not see these bytes
            k[pages] = math.nan
            v[pages] = math.nan
        for tensors in self._states.values():
            for tensor in tensors:
                tensor[slot] = math.nan
        self.free_pages += pages
        self.free_slots.append(slot)

    def page_ids(self, request_id: str) -> torch.Tensor:
        return torch.tensor(self._pages[request_id], dtype=torch.int64)

    def slot_id(self, request_id: str) -> int:
        return self._slot[request_id]

    def num_tokens(self, request_id: str) -> int:
        return self._tokens[request_id]

    @property
    def request_ids(self) -> list[str]:
        return list(self._tokens)

    # ---- memory ------------------------------------------------------------------------------
    def kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of attention layer `layer`, each (num_pages, page_size, kv_heads, head_dim)."""
        return self._kv[layer]

    def state_view(self, layer: int) -> tuple[torch.Tensor, ...]:
        """(conv, ssm) of Mamba layer `layer`, each (num_slots, *shape)."""
        return self._states[layer]

    def shuffle(self, generator: torch.Generator) -> None:
        """Move page p to page_perm[p] and slot s to slot_perm[s], bytes and ids alike."""
        page_perm = torch.randperm(self.num_pages, generator=generator)
        slot_perm = torch.randperm(self.num_slots, generator=generator)
        for layer, (k, v) in self._kv.items():
            moved_k, moved_v = torch.empty_like(k), torch.empty_like(v)
            moved_k[page_perm], moved_v[page_perm] = k, v
            self._kv[layer] = (moved_k, moved_v)
        for layer, tensors in self._states.items():
            moved = tuple(torch.empty_like(t) for t in tensors)
            for dst, src in zip(moved, tensors, strict=True):
                dst[slot_perm] = src
            self._states[layer] = moved
        self._pages = {rid: [int(page_perm[p]) for p in pages] for rid, pages in self._pages.items()}
        self._slot = {rid: int(slot_perm[s]) for rid, s in self._slot.items()}
        self.free_pages = [int(page_perm[p]) for p in self.free_pages]
        self.free_slots = [int(slot_perm[s]) for s in self.free_slots]

    def check_invariants(self) -> None:
        owned_pages = [p for pages in self._pages.values() for p in pages]
        assert sorted(owned_pages + self.free_pages) == list(range(self.num_pages)), (
            "page owned twice or lost"
        )
        assert sorted([*self._slot.values(), *self.free_slots]) == list(range(self.num_slots)), "slot lost"
        for rid, pages in self._pages.items():
            assert len(pages) == self._pages_for(self._tokens[rid]), f"{rid} holds the wrong page count"
