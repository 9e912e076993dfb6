"""What a request of n tokens holds: the allocator's contract on token ranges, as a frozen value.

- one slot (hybrid Mamba: the low band's unit), whatever n is;
- `ceil(n / page_size)` full-attention pages (the high band), page k holding tokens
  [k * page_size, (k + 1) * page_size);
- (hybrid SWA) the sliding-window pages (the low band's units) covering its last `sliding_window`
  tokens; pages whose every token left the window are released as the request grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distpool.memory.alloc.requests import RequestTable, checked_batch
from distpool.memory.arena import require
from distpool.memory.sizing import ceil_div


@dataclass(frozen=True)
class Footprint:
    """Units per request for a pool with `has_pages` (a high band), `has_slot` or `has_swa` (what the
    low band holds), `page_size` tokens per page and an optional `sliding_window` in tokens."""

    page_size: int
    sliding_window: int | None
    has_pages: bool
    has_slot: bool
    has_swa: bool

    def pages_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.page_size) if self.has_pages else 0

    def swa_range(self, num_tokens: int) -> tuple[int, int]:
        """Token-page indices [first, end) of the window's pages (the last `sliding_window` tokens)."""
        if not self.has_swa:
            return 0, 0
        kept_from = max(0, num_tokens - self.sliding_window) if self.sliding_window else 0
        return kept_from // self.page_size, ceil_div(num_tokens, self.page_size)

    def low_units_for(self, num_tokens: int) -> int:
        first, end = self.swa_range(num_tokens)
        return int(self.has_slot) + end - first

    def pages_for_array(self, num_tokens: np.ndarray) -> np.ndarray:
        return -(-num_tokens // self.page_size) if self.has_pages else np.zeros_like(num_tokens)

    def swa_range_array(self, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.has_swa:
            return np.zeros_like(num_tokens), np.zeros_like(num_tokens)
        window = self.sliding_window or 0
        kept_from = np.maximum(num_tokens - window, 0) if window else np.zeros_like(num_tokens)
        return kept_from // self.page_size, -(-num_tokens // self.page_size)

    def growth_array(self, old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Requests growing from `old` to `new` tokens: (full pages they take, window pages they
        take, window pages they drop from the front of their window)."""
        new_pages = self.pages_for_array(new) - self.pages_for_array(old)
        held_first, held_end = self.swa_range_array(old)
        first, end = self.swa_range_array(new)
        new_swa = np.maximum(end - np.maximum(held_end, first), 0)
        drops = np.minimum(np.maximum(first - held_first, 0), held_end - held_first)
        return new_pages, new_swa, drops

    def growth_pages(
        self, ids: Sequence[str], counts: list[int], final_tokens: Sequence[int] | None
    ) -> list[int]:
        """Pages each reserved request expects to grow by, from its final length (0 without one)."""
        if final_tokens is None:
            return [0] * len(counts)
        if len(final_tokens) != len(counts):
            raise ValueError(f"reserve: {len(final_tokens)} final lengths for {len(counts)} requests")
        _, finals = checked_batch(list(zip(ids, final_tokens, strict=True)), "reserve (final length)")
        pages = self.pages_for
        return [max(0, pages(f) - pages(n)) for f, n in zip(finals.tolist(), counts, strict=True)]

    def check(self, table: RequestTable) -> None:
        """Every live request of `table` holds exactly what its token count calls for."""
        for rid, r in table.rows.items():
            n = int(table.num_tokens[r])
            first, end = self.swa_range(n)
            require(
                len(table.vpages[r]) == self.pages_for(n),
                "pages-cover-tokens",
                "one page per page_size tokens",
                rid,
            )
            require(int(table.vslot[r] >= 0) == int(self.has_slot), "one-slot", "one slot per request", rid)
            require(len(table.vswa[r]) == end - first, "window-pages", "window pages cover the window", rid)
