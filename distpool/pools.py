"""The pool: an arena (bytes) plus an allocator (ids), behind the `Pool` protocol.

One class serves both modes, so the rest of the system and the benchmarks swap one for the other:
- unified (`--enable-unified-memory`): the frontier between the low band (Mamba slots, or
  sliding-window pages) and the high band (full-attention pages) moves; `compact()` closes holes.
- static (the baseline): a fixed state pool (or SWA pool) and a fixed KV pool, split at boot by the
  plan's ratio; each band has its planned size and `compact()` moves nothing.
Dense models have only the high band; attention-free models only the low band.

Reserves never compact implicitly: a reserve that would fit after compaction raises
`NeedsCompaction` (a `DoesNotFit`), and the caller decides when to pay for `compact()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distpool.allocator import Allocator
from distpool.arena import Arena, BandLayout
from distpool.configurator import PoolPlan
from distpool.envelope import Envelope
from distpool.layout import layout_fingerprint


class ArenaPool:
    """A pool over one arena: unified or static according to `plan.unified`."""

    def __init__(self, plan: PoolPlan, device: torch.device | str = "cpu") -> None:
        self.plan = plan
        self.memory = Arena(plan, device)
        self.arena = self.memory.buffer  # uint8 (arena_bytes,): every byte this pool owns
        self.page_size = plan.page_size
        self.fingerprint = layout_fingerprint(plan)
        self.allocator = Allocator(
            self.memory.low,
            self.memory.high,
            page_size=plan.page_size,
            sliding_window=plan.spec.sliding_window,
            unified=plan.unified,
        )

    @property
    def kind(self) -> str:
        return "unified" if self.plan.unified else "static"

    @property
    def low(self) -> BandLayout | None:
        return self.memory.low

    @property
    def high(self) -> BandLayout | None:
        return self.memory.high

    # ---- ownership -----------------------------------------------------------------------------
    def can_reserve(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` fits now, without compaction."""
        return self.allocator.can_reserve(num_tokens)

    def can_reserve_after_compaction(self, num_tokens: int) -> bool:
        return self.allocator.can_reserve(num_tokens, after_compaction=True)

    def reserve(self, request_id: str, num_tokens: int) -> None:
        """Reserve a slot and the pages for `num_tokens`; raises DoesNotFit (holding nothing)."""
        self.allocator.reserve_batch([(request_id, num_tokens)])

    def reserve_batch(self, requests: Sequence[tuple[str, int]]) -> None:
        """Reserve every (request_id, num_tokens), all or nothing."""
        self.allocator.reserve_batch(requests)

    def extend(self, request_id: str, num_new_tokens: int) -> None:
        self.allocator.extend_batch([(request_id, num_new_tokens)])

    def extend_batch(self, requests: Sequence[tuple[str, int]]) -> None:
        """Grow every (request_id, num_new_tokens), all or nothing."""
        self.allocator.extend_batch(requests)

    def release(self, request_id: str) -> None:
        self.allocator.release_batch([request_id])

    def release_batch(self, request_ids: Sequence[str]) -> None:
        self.allocator.release_batch(request_ids)

    def pin(self, request_id: str) -> None:
        """Hold the envelope in place (a transfer reads or writes it); pins nest."""
        self.allocator.pin(request_id)

    def unpin(self, request_id: str) -> None:
        self.allocator.unpin(request_id)

    @property
    def request_ids(self) -> list[str]:
        return list(self.allocator.holdings)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.allocator.holdings

    # ---- physical ids (valid until the next compact()) -------------------------------------
    def page_ids(self, request_id: str) -> torch.Tensor:
        """Physical full-attention page ids, int64, token order."""
        return self.allocator.page_ids(request_id)

    def swa_page_ids(self, request_id: str) -> torch.Tensor:
        """Physical sliding-window page ids of the window, int64, token order."""
        return self.allocator.swa_page_ids(request_id)

    def swa_first_page(self, request_id: str) -> int:
        """Token-page index of `swa_page_ids(request_id)[0]` (earlier pages left the window)."""
        return self.allocator.swa_first_page(request_id)

    def slot_id(self, request_id: str) -> int:
        """Physical slot id; -1 for a model without recurrent state."""
        slot = self.allocator.slot_id(request_id)
        return -1 if slot is None else slot

    def num_tokens(self, request_id: str) -> int:
        return self.allocator.num_tokens(request_id)

    # ---- views ------------------------------------------------------------------------------
    def kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of full-attention layer `layer`: each (num_page_positions, page_size, kv_heads, dim)."""
        return self.memory.kv_view(layer)

    def swa_kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of sliding-window layer `layer`: each (num_swa_positions, page_size, kv_heads, dim)."""
        return self.memory.swa_kv_view(layer)

    def state_view(self, layer: int) -> tuple[torch.Tensor, ...]:
        """One (num_slot_positions, *shape) tensor per MambaSpec.tensors entry of Mamba layer `layer`."""
        return self.memory.state_view(layer)

    # ---- envelopes --------------------------------------------------------------------------
    def envelope_ranges(self, request_id: str) -> torch.Tensor:
        """(n, 2) int64 [offset, nbytes]: the slot, each full page in token order, then each
        window page in token order. nbytes is the unit's stride (padding included)."""
        parts = [torch.empty((0, 2), dtype=torch.int64)]
        slot = self.allocator.slot_id(request_id)
        low, high = self.memory.low, self.memory.high
        if slot is not None and low is not None:
            parts.append(torch.tensor([[low.base_bytes + slot * low.stride_bytes, low.stride_bytes]]))
        for layout, ids in ((high, self.page_ids(request_id)), (low, self.swa_page_ids(request_id))):
            if layout is not None and ids.numel():
                nbytes = torch.full_like(ids, layout.stride_bytes)
                parts.append(torch.stack([layout.offsets(ids), nbytes], dim=1))
        return torch.cat(parts)

    def envelope(self, request_id: str) -> Envelope:
        """The request's envelope: physical ids (slot None without recurrent state) and byte count."""
        ranges = self.envelope_ranges(request_id)
        return Envelope(
            request_id=request_id,
            fingerprint=self.fingerprint,
            page_ids=tuple(self.page_ids(request_id).tolist()),
            slot_id=self.allocator.slot_id(request_id),
            num_tokens=self.num_tokens(request_id),
            num_bytes=int(ranges[:, 1].sum()),
        )

    # ---- compaction and accounting --------------------------------------------------------------
    def compact(self) -> int:
        """Pack the bands around pinned envelopes (unified only); returns bytes moved."""
        plan = self.allocator.plan_compaction()
        self.memory.copy_runs(plan.runs_bytes)
        self.allocator.apply_compaction(plan)
        return plan.bytes_moved

    def available(self) -> dict[str, int]:
        """Units that could be handed out now (`*_available`) and after compact() (`*_schedulable`).
        Unified: slots and pages both count the shared gap between the bands."""
        low_now, high_now = self.allocator.available()
        low_later, high_later = self.allocator.available(after_compaction=True)
        low_name = self.memory.low.name if self.memory.low else "slots"
        out = {"pages_available": 0, "slots_available": 0, "swa_pages_available": 0}
        out |= {"pages_schedulable": 0, "slots_schedulable": 0, "swa_pages_schedulable": 0}
        if self.memory.high is not None:
            out["pages_available"], out["pages_schedulable"] = high_now, high_later
        if self.memory.low is not None:
            out[f"{low_name}_available"], out[f"{low_name}_schedulable"] = low_now, low_later
        return out

    def stats(self) -> dict[str, int]:
        """Per band (pages, slots, swa_pages): capacity, free, used (unpinned live requests), reserved
        (pinned requests), held (used + reserved), available and schedulable; plus request counts."""
        out = self.allocator.counts() | self.available()
        for name in ("pages", "slots", "swa_pages"):
            out[f"{name}_held"] = out[f"{name}_used"] + out[f"{name}_reserved"]
        out["num_requests"] = len(self.allocator.holdings)
        out["num_pinned_requests"] = sum(1 for h in self.allocator.holdings.values() if h.pins)
        return out

    def free_capacity(self) -> dict[str, int]:
        """Positions nobody owns, per band; equal to a fresh pool's once every request is released."""
        counts = self.allocator.counts()
        return {name: counts[f"{name}_free"] for name in ("pages", "slots", "swa_pages")}

    def check_invariants(self) -> None:
        """Raise AssertionError naming the broken accounting invariant (see Allocator.check_invariants)."""
        self.allocator.check_invariants()


def build_pool(plan: PoolPlan, device: torch.device | str = "cpu") -> ArenaPool:
    """The pool `plan` describes, its arena allocated on `device`."""
    return ArenaPool(plan, device)
