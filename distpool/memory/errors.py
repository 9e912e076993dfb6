"""What a pool answers with when it cannot: its errors, and one band's usage (`Pool.usage`).

They sit below every other part of memory, so the allocator, the prefix cache and the `Pool`
interface (pool.py, which names them for callers) all raise the same types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class DoesNotFit(Exception):
    """A reserve or extend that the pool cannot satisfy now; nothing was taken. Where the pool
    counted: `low` / `pages` the low-band units (slots, window pages) and the pages the call needed,
    `low_free` / `pages_free` those free then, `pinned` the requests a transfer held (0 where not
    counted)."""

    def __init__(
        self,
        request_id: str,
        reason: str,
        *,
        low: int = 0,
        pages: int = 0,
        low_free: int = 0,
        pages_free: int = 0,
        pinned: int = 0,
    ) -> None:
        super().__init__(f"request {request_id!r} does not fit: {reason}")
        self.request_id = request_id
        self.reason = reason
        self.low, self.pages, self.low_free, self.pages_free = low, pages, low_free, pages_free
        self.pinned = pinned

    def __reduce__(self):  # crosses Ray's process boundary as itself, so callers can catch it by type
        return type(self), (self.request_id, self.reason), self.__dict__


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
        super().__init__(request_id, reason, low=low, pages=pages)
        self.window, self.window_at = window, window_at


class UnknownRequest(KeyError):
    """A request id the pool does not hold."""


class DuplicateRequest(ValueError):
    """Call `call` (reserve, extend, release, ...) named request `request_id` that the pool already
    holds, or, where `batch` holds the batch's ids, twice in that one batch."""

    def __init__(self, call: str, request_id: str, batch: Sequence[str] = ()) -> None:
        self.call, self.request_id, self.batch = call, request_id, tuple(batch)
        if self.batch:
            super().__init__(f"{call}: a request id appears twice in one batch: {list(self.batch)}")
        else:
            super().__init__(f"{call}: request {request_id!r} is already reserved")

    @classmethod
    def in_batch(cls, call: str, ids: Sequence[str]) -> DuplicateRequest:
        """The refusal of batch `ids`, in which some id appears twice (the first such names it)."""
        repeated = next(rid for i, rid in enumerate(ids) if rid in ids[:i])  # an error path: n^2 is fine
        return cls(call, repeated, ids)

    def __reduce__(self):
        return type(self), (self.call, self.request_id, self.batch)


class RequestPinned(ValueError):
    """Call `call` (a release or extend) of request `request_id`, whose envelope a transfer holds
    (pinned)."""

    def __init__(self, call: str, request_id: str) -> None:
        super().__init__(f"{call}: request {request_id!r} is pinned by a transfer; unpin it first")
        self.call, self.request_id = call, request_id

    def __reduce__(self):
        return type(self), (self.call, self.request_id)


class NotPinned(ValueError):
    """An unpin of request `request_id`, which no transfer pins."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"unpin: request {request_id!r} is not pinned")
        self.request_id = request_id

    def __reduce__(self):
        return type(self), (self.request_id,)


class BadTokenCount(ValueError):
    """Call `call` gave request `request_id` the token count `value`, which is not a non-negative
    int (a bool is not a count)."""

    def __init__(self, call: str, request_id: str, value: object) -> None:
        super().__init__(f"{call} {request_id!r}: token count must be a non-negative int; got {value!r}")
        self.call, self.request_id, self.value = call, request_id, value

    def __reduce__(self):
        return type(self), (self.call, self.request_id, self.value)


class NotALayerOf(ValueError):
    """A view of layer `layer` as a `kind` layer ("full-attention", "sliding-window", "Mamba"),
    which it is not: the pool's `kind` layers are `layers` (none: the pool keeps no such layer)."""

    def __init__(self, layer: int, kind: str, layers: Sequence[int]) -> None:
        self.layer, self.kind, self.layers = layer, kind, tuple(layers)
        if self.layers:
            super().__init__(
                f"layer {layer} is not a {kind} layer of this model; {kind} layers: {list(self.layers)}"
            )
        else:
            super().__init__(f"this model has no {kind} layers; asked for layer {layer}")

    def __reduce__(self):
        return type(self), (self.layer, self.kind, self.layers)


class KeepsNoCheckpoints(ValueError):
    """A state checkpoint asked of a prefix cache that keeps pages only (no recurrent state, or a
    decode pool's cache)."""

    def __init__(self) -> None:
        super().__init__("this prefix cache keeps pages only: it takes no state checkpoints")


# ---- the prefix index's refusals: a caller's misuse (a stale match, a handle named twice, ...) -------
class StaleMatch(ValueError):
    """`acquire` of `match` (a `PrefixMatch`), whose checkpoint was evicted since it was matched."""

    def __init__(self, match: object) -> None:
        super().__init__(f"stale match {match}: its checkpoint was evicted since; match again")
        self.match = match

    def __reduce__(self):
        return type(self), (self.match,)


class NotAcquired(ValueError):
    """`release` of cached pages `pages` that no request acquired (or released once too often)."""

    def __init__(self, pages: Sequence[int]) -> None:
        self.pages = tuple(pages)
        super().__init__(f"pages {list(self.pages)} were not acquired (or are released once too often)")

    def __reduce__(self):
        return type(self), (self.pages,)


class NotACachedPrefix(ValueError):
    """Pages `pages` named as a cached prefix, which they are not from page `page` on (evicted
    since they were matched, or never a path from the root)."""

    def __init__(self, pages: Sequence[int], page: int) -> None:
        self.pages, self.page = tuple(pages), page
        super().__init__(f"pages {list(self.pages)} are not a cached prefix (page {page}); match again")

    def __reduce__(self):
        return type(self), (self.pages, self.page)


class HandlesReused(ValueError):
    """An `insert` whose new handles `handles` repeat or are cached already: a handle names one entry."""

    def __init__(self, handles: Sequence[int]) -> None:
        self.handles = tuple(handles)
        super().__init__(
            f"handles {list(self.handles)} repeat or are cached already: each handle names one entry"
        )

    def __reduce__(self):
        return type(self), (self.handles,)


class CheckpointsRefused(ValueError):
    """An `insert` with checkpoints at `depths`: an index that keeps none (`keeps_checkpoints`
    False: attention / SWA) takes none; one that keeps them takes depths 1..`full_pages`."""

    def __init__(self, depths: Sequence[int], full_pages: int, keeps_checkpoints: bool) -> None:
        self.depths, self.full_pages, self.keeps_checkpoints = tuple(depths), full_pages, keeps_checkpoints
        if keeps_checkpoints:
            super().__init__(f"checkpoint depths {list(self.depths)} must lie in 1..{full_pages}")
        else:
            super().__init__("index built with needs_checkpoint=False (attention / SWA): pass no checkpoints")

    def __reduce__(self):
        return type(self), (self.depths, self.full_pages, self.keeps_checkpoints)


class PagesStillHeld(RuntimeError):
    """`drop_all` while requests still hold `held` cached pages."""

    def __init__(self, held: int) -> None:
        super().__init__(f"{held} cached pages are still held by requests: release them first")
        self.held = held

    def __reduce__(self):
        return type(self), (self.held,)


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
