"""The pool: an arena (bytes) plus an allocator (ids), behind the `Pool` interface.

One class serves both modes, so the rest of the system and the benchmarks swap one for the other:
- unified (`PoolArgs.enable_unified_memory`): the frontier between the low band (Mamba slots, or
  sliding-window pages) and the high band (full-attention pages) moves; compaction closes holes.
- static (the baseline): a fixed state pool (or SWA pool) and a fixed KV pool, split at boot by the
  sizes' ratio; each band has its planned size and compaction moves nothing.
Dense models have only the high band; attention-free models only the low band.

Compaction happens only when a caller allows it (`compact=True`, or `compact()`): a reserve that
would fit after compaction otherwise raises `NeedsCompaction` (a `DoesNotFit`). With a prefix cache
(prefix_cache.py), idle cached entries are evicted before a request is refused (refusals.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from distpool.memory.alloc import Allocator
from distpool.memory.arena import Arena
from distpool.memory.envelope import Envelope
from distpool.memory.errors import BandUsage, NeedsCompaction
from distpool.memory.prefix import FinalStates, PrefixCache, PrefixMatch
from distpool.memory.refusals import compacting_if, evicting_if
from distpool.memory.sizing import PoolSizes, layout_fingerprint


class ArenaPool:
    """A pool over one arena: unified or static according to `sizes.unified`."""

    def __init__(
        self,
        sizes: PoolSizes,
        device: torch.device | str = "cpu",
        *,
        placement: str = "extent",
        prefix_cache: bool = False,
        checkpoints: bool = True,
        final_states: bool = False,
    ) -> None:
        self.sizes = sizes
        self.arena = Arena(sizes, device)
        self.buffer = self.arena.buffer  # uint8 (arena_bytes,): every byte this pool owns
        self.page_size = sizes.page_size
        self.fingerprint = layout_fingerprint(sizes)
        self.allocator = Allocator(
            self.arena.low,
            self.arena.high,
            page_size=sizes.page_size,
            sliding_window=sizes.spec.sliding_window,
            unified=sizes.unified,
            placement=placement,  # where pages go: "extent", or the "first_fit" baseline
        )
        self._compactions = (0, 0, 0.0)  # count, bytes moved, seconds
        # Full pages by token content, and (hybrid Mamba) state checkpoints: prefix_cache.py.
        # Not for sliding-window models: their window pages are each request's own to compute.
        # `checkpoints=False` (a decode pool) keeps no checkpoints at page boundaries: a request's state
        # arrives whole, or continues a finished request's final state (final_states.py).
        cacheable = prefix_cache and self.arena.high is not None and not self.allocator.has_swa
        state = self.allocator.has_slot and checkpoints
        cache = PrefixCache(self.allocator, sizes.page_size, needs_checkpoint=state) if cacheable else None
        if cache is not None and self.allocator.has_slot and not checkpoints and final_states:
            # A decode pool keeps its finished requests' final states: a next turn can continue there.
            cache.final_states = FinalStates(self.allocator, self.arena, cache.index, sizes.page_size)
        self.prefix_cache = cache

    @property
    def kind(self) -> str:
        return "unified" if self.sizes.unified else "static"

    # ---- ownership -----------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        """Full-attention pages a request of `num_tokens` holds."""
        return self.allocator.pages_for(num_tokens)

    def can_reserve(self, num_tokens: int, *, compact: bool = False) -> bool:
        """Whether a request of `num_tokens` fits now (or, with `compact`, after a compaction)."""
        if self.allocator.can_reserve(num_tokens):
            return True
        return compact and self.allocator.can_reserve(num_tokens, after_compaction=True)

    def make_room(self, num_tokens: int, *, compact: bool = False) -> bool:
        """`can_reserve`, evicting idle cached prefixes while it says no: whether a request of
        `num_tokens` fits now. Cached memory yields to requests, but only what they need goes."""
        pages, low_units = max(self.pages_for(num_tokens), 1), self.allocator.low_units_for(num_tokens)
        while not self.can_reserve(num_tokens, compact=compact):
            if self.prefix_cache is None or not self.prefix_cache.evict(pages, low_units):
                return False
        return True

    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        *,
        compact: bool = False,
        final_tokens: int | None = None,
        prefix: PrefixMatch | None = None,
    ) -> None:
        """Reserve a slot and the pages for `num_tokens`; raises DoesNotFit (holding nothing).
        `final_tokens`: the length the request expects to reach (a placement hint, nothing held).
        `prefix`: a `prefix_cache.match` answer: the request's first pages are those cached pages."""
        finals = None if final_tokens is None else [final_tokens]
        prefixes = None if prefix is None else [prefix]
        self.reserve_batch(
            [(request_id, num_tokens)], compact=compact, final_tokens=finals, prefixes=prefixes
        )

    def reserve_batch(
        self,
        requests: Sequence[tuple[str, int]],
        *,
        compact: bool = False,
        final_tokens: Sequence[int] | None = None,
        prefixes: Sequence[PrefixMatch] | None = None,
    ) -> None:
        """Reserve every (request_id, num_tokens), all or nothing; the rest as in `reserve`."""
        cache, ids = self.prefix_cache, [rid for rid, _ in requests]
        shared = None if prefixes is None else [m.pages for m in prefixes]
        if shared and any(shared) and cache is None:
            raise ValueError("reserve: a prefix needs a pool with a prefix cache")

        def take(batch: Sequence, whole: bool = False) -> None:
            self.allocator.reserve_batch(batch, final_tokens, prefer_compaction=whole, prefixes=shared)

        def attempt() -> None:
            compacting_if(compact, take, requests, self.compact)

        acquiring = cache is not None and prefixes is not None
        if acquiring:  # acquired first: eviction spares them, a refusal gives them back
            cache.acquire_all(ids, prefixes)
        try:
            evicting_if(attempt, cache, requests, len(requests), self.pages_for)
        except BaseException:
            if acquiring:
                cache.release_all(ids)
            raise

    def extend(self, request_id: str, num_new_tokens: int, *, compact: bool = False) -> None:
        self.extend_batch([(request_id, num_new_tokens)], compact=compact)

    def extend_batch(self, requests: Sequence[tuple[str, int]], *, compact: bool = False) -> None:
        """Grow every (request_id, num_new_tokens), all or nothing."""
        grow = lambda batch, whole=False: self.allocator.extend_batch(batch, prefer_compaction=whole)  # noqa: E731
        attempt = lambda: compacting_if(compact, grow, requests, self.compact)  # noqa: E731
        evicting_if(attempt, self.prefix_cache, requests, 0, self.pages_for)

    def release(self, request_id: str) -> None:
        self.release_batch([request_id])

    def release_batch(self, request_ids: Sequence[str]) -> None:
        self.allocator.release_batch(request_ids)
        if self.prefix_cache is not None:
            self.prefix_cache.release_all(request_ids)

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

    # ---- physical ids (valid until the next compaction) -------------------------------------
    def page_ids(self, request_id: str) -> torch.Tensor:
        """Physical full-attention page ids, int64, token order."""
        return self.allocator.page_ids(request_id)

    def swa_page_ids(self, request_id: str) -> torch.Tensor:
        """Physical sliding-window page ids of the window, int64, token order."""
        return self.allocator.swa_page_ids(request_id)

    def swa_first_page(self, request_id: str) -> int:
        """Token-page index of `swa_page_ids(request_id)[0]` (earlier pages left the window)."""
        return self.allocator.swa_first_page(request_id)

    def slot_id(self, request_id: str) -> int | None:
        """Physical slot id; None for a model without recurrent state."""
        return self.allocator.slot_id(request_id)

    def num_tokens(self, request_id: str) -> int:
        return self.allocator.num_tokens(request_id)

    # ---- views ------------------------------------------------------------------------------
    def kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of full-attention layer `layer`: each (num_page_positions, page_size, kv_heads, dim)."""
        return self.arena.kv_view(layer)

    def swa_kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of sliding-window layer `layer`: each (num_swa_positions, page_size, kv_heads, dim)."""
        return self.arena.swa_kv_view(layer)

    def state_view(self, layer: int) -> tuple[torch.Tensor, ...]:
        """One (num_slot_positions, *shape) tensor per MambaSpec.tensors entry of Mamba layer `layer`."""
        return self.arena.state_view(layer)

    # ---- envelopes --------------------------------------------------------------------------
    def envelope_ranges(self, request_id: str) -> torch.Tensor:
        """(n, 2) int64 [offset, nbytes] in canonical order (`Arena.byte_ranges`)."""
        slot = self.allocator.slot_id(request_id)
        return self.arena.byte_ranges(slot, self.page_ids(request_id), self.swa_page_ids(request_id))

    def envelope(self, request_id: str, *, held_pages: int = 0) -> Envelope:
        """The request's envelope: its byte ranges (valid until the next compaction; a transfer pins
        them). `held_pages`: its first pages a transfer into it must not move (a prefix held here)."""
        return Envelope(
            request_id=request_id,
            num_tokens=self.num_tokens(request_id),
            ranges=self.envelope_ranges(request_id),
            has_slot=self.allocator.slot_id(request_id) is not None,
            held_pages=held_pages,
        )

    # ---- compaction and accounting --------------------------------------------------------------
    def compact(self, *, keep_room: bool = False, need: NeedsCompaction | None = None) -> int:
        """Pack the bands around pinned envelopes (unified only); returns bytes moved. By default
        the full compaction after which a `NeedsCompaction` refusal fits. keep_room: requests keep
        their free growth room after them; need: a refusal's needs (move only what is in the way)."""
        start = time.perf_counter()
        moves = self.allocator.compaction_moves(keep_room=keep_room, need=need)
        self.arena.copy_runs(moves.runs_bytes)
        self.allocator.apply_compaction(moves)
        count, moved, seconds = self._compactions
        self._compactions = (count + 1, moved + moves.bytes_moved, seconds + time.perf_counter() - start)
        return moves.bytes_moved

    def compactions(self) -> tuple[int, int, float]:
        """Compactions so far: how many, the bytes they moved and the seconds they took."""
        return self._compactions

    def available(self, *, after_compaction: bool = False) -> dict[str, int]:
        """Units per band that could be handed out now (or after a compaction). Unified: the low
        band and the pages each count the shared gap between the bands."""
        low_units, pages = self.allocator.available(after_compaction=after_compaction)
        out = {"pages": pages} if self.arena.high is not None else {}
        if self.arena.low is not None:
            out[self.arena.low.name] = low_units
        return out

    def usage(self) -> dict[str, BandUsage]:
        """Per band present ("pages", "slots" or "swa_pages"): capacity, free, held, pinned."""
        return self.allocator.usage()

    def check_invariants(self) -> None:
        """Raise InvariantBroken naming the broken accounting invariant (see Allocator.check_invariants)."""
        self.allocator.check_invariants()
        if self.prefix_cache is not None:
            self.prefix_cache.check()


def build_pool(
    sizes: PoolSizes,
    device: torch.device | str = "cpu",
    *,
    placement: str = "extent",
    checkpoints: bool = True,
    final_states: bool = False,
) -> ArenaPool:
    """The pool `sizes` describes, its arena allocated on `device` (with a prefix cache when
    `sizes.args.prefix_cache`). `checkpoints=False`: the cache keeps no state checkpoints at page
    boundaries, for a pool whose requests get their state whole from elsewhere, or
    (`final_states=True`, a next turn prefilled in place) from a finished request's final state."""
    return ArenaPool(
        sizes,
        device,
        placement=placement,
        prefix_cache=sizes.args.prefix_cache,
        checkpoints=checkpoints,
        final_states=not checkpoints and final_states,
    )
