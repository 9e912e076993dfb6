"""What a pool answers with when it cannot: its errors, and one band's usage (`Pool.usage`).

They sit below every other part of memory, so the allocator, the prefix cache and the `Pool`
interface (pool.py, which names them for callers) all raise the same types.
"""

from __future__ import annotations

from dataclasses import dataclass


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
