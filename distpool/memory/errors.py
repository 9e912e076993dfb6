"""What a pool answers with when it cannot: its errors, and one band's usage (`Pool.usage`).

They sit below every other part of memory, so the allocator, the prefix cache and the `Pool`
interface (pool.py, which names them for callers) all raise the same types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from distpool.facts import Facts


class DoesNotFit(Facts, Exception):
    """A reserve or extend that the pool cannot satisfy now; nothing was taken. Where the allocator
    refuses: `low` / `pages`, the low-band units (slots, window pages) and the pages the call
    needed; `low_free` / `pages_free`, what was free then; `pinned`, the requests a transfer held."""

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
        self.low, self.pages, self.low_free, self.pages_free, self.pinned = (
            low,
            pages,
            low_free,
            pages_free,
            pinned,
        )


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
        low_free: int = 0,
        pages_free: int = 0,
    ) -> None:
        super().__init__(request_id, reason, low=low, pages=pages, low_free=low_free, pages_free=pages_free)
        self.window, self.window_at = window, window_at


class UnknownRequest(Facts, KeyError):
    """A request id the pool does not hold (`request_id`)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"unknown request {request_id!r}")
        self.request_id = request_id


class DuplicateRequest(Facts, ValueError):
    """`call` ("reserve", "release", "extend") named `request_id` twice in one batch
    (`in_batch`), or reserved a request id the pool already holds (not `in_batch`)."""

    def __init__(self, call: str, request_id: str, in_batch: bool) -> None:
        where = "appears twice in one batch" if in_batch else "is already reserved"
        super().__init__(f"{call}: request {request_id!r} {where}")
        self.call, self.request_id, self.in_batch = call, request_id, in_batch


class RequestPinned(Facts, ValueError):
    """`call` ("release", "extend") of a request (`request_id`) whose envelope a transfer holds
    (pinned): it may not move or be released until it is unpinned."""

    def __init__(self, call: str, request_id: str) -> None:
        super().__init__(f"{call}: request {request_id!r} is pinned by a transfer")
        self.call, self.request_id = call, request_id


class NotPinned(Facts, ValueError):
    """An unpin of a request (`request_id`) no transfer holds."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"unpin: request {request_id!r} is not pinned")
        self.request_id = request_id


class TokenCountInvalid(Facts, ValueError):
    """`call` gave a request (`request_id`) a token count (`value`) that is not an int >= 0 (a bool
    is no count)."""

    def __init__(self, call: str, request_id: str, value: object) -> None:
        super().__init__(f"{call} {request_id!r}: token count must be a non-negative int; got {value!r}")
        self.call, self.request_id, self.value = call, request_id, value


class EnvelopeInvalid(Facts, ValueError):
    """An envelope whose `field` ("request_id", "num_tokens", "ranges") holds `value` (for ranges:
    its shape, dtype and device, as text) where it must be `expected`."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        super().__init__(f"{field} must be {expected}, got {value!r}")
        self.field, self.value, self.expected = field, value, expected


class RequestIdInvalid(EnvelopeInvalid):
    """A request id (`value`) that is not a str of 1 to `limit` characters."""

    def __init__(self, value: object, limit: int) -> None:
        expected = f"a str of 1 to {limit} characters"
        ValueError.__init__(self, f"a request id is {expected}, got {value!r}")
        self.field, self.value, self.expected, self.limit = "request_id", value, expected, limit


class HeldPagesInvalid(Facts, ValueError):
    """`held_pages` pages said held at the destination, of a table with only `pages` pages (or a
    negative count): no transfer can skip them."""

    def __init__(self, held_pages: object, pages: int) -> None:
        super().__init__(f"{held_pages} held pages, but the table has {pages} pages")
        self.held_pages, self.pages = held_pages, pages


class InvariantBroken(Facts, AssertionError):
    """A `check` found the pool's accounting broken: `code` names the invariant (short and stable),
    `statement` says what should hold, `subject` what broke it ("high band", a request id, a cached
    page; "": the structure as a whole)."""

    def __init__(self, code: str, statement: str, subject: str = "") -> None:
        where = f"{subject}: " if subject else ""
        super().__init__(f"invariant broken: {where}{statement}")
        self.code, self.statement, self.subject = code, statement, subject


class NotALayerOfKind(Facts, ValueError):
    """A view of `layer` as a layer of `kind` ("full-attention", "sliding-window", "Mamba"), which
    it is not: the model's layers of that kind are `layers` (empty: it has none)."""

    def __init__(self, layer: int, kind: str, layers: tuple[int, ...]) -> None:
        if layers:
            text = f"layer {layer} is not a {kind} layer of this model; {kind} layers: {list(layers)}"
        else:
            text = f"this model has no {kind} layers; asked for layer {layer}"
        super().__init__(text)
        self.layer, self.kind, self.layers = layer, kind, tuple(layers)


class PlacementUnknown(Facts, ValueError):
    """A placement policy `mode` that is none of `known`."""

    def __init__(self, mode: object, known: Sequence[str]) -> None:
        self.mode, self.known = mode, tuple(known)
        super().__init__(f"placement must be one of {self.known}; got {mode!r}")


class KeepsNoCheckpoints(Facts, ValueError):
    """A state checkpoint asked of a prefix cache that keeps pages only (no recurrent state, or a
    decode pool's cache)."""

    def __init__(self) -> None:
        super().__init__("this prefix cache keeps pages only: it takes no state checkpoints")


# ---- the prefix index's refusals: a caller's misuse (a stale match, a handle named twice, ...) -------
class StaleMatch(Facts, ValueError):
    """`acquire` of `match` (a `PrefixMatch`), whose checkpoint was evicted since it was matched."""

    def __init__(self, match: object) -> None:
        super().__init__(f"stale match {match}: its checkpoint was evicted since; match again")
        self.match = match


class NotAcquired(Facts, ValueError):
    """`release` of cached pages `pages` that no request acquired (or released once too often)."""

    def __init__(self, pages: Sequence[int]) -> None:
        self.pages = tuple(pages)
        super().__init__(f"pages {list(self.pages)} were not acquired (or are released once too often)")


class NotACachedPrefix(Facts, ValueError):
    """Pages `pages` named as a cached prefix, which they are not from page `page` on (evicted
    since they were matched, or never a path from the root)."""

    def __init__(self, pages: Sequence[int], page: int) -> None:
        self.pages, self.page = tuple(pages), page
        super().__init__(f"pages {list(self.pages)} are not a cached prefix (page {page}); match again")


class HandlesReused(Facts, ValueError):
    """An `insert` whose new handles `handles` repeat or are cached already: a handle names one entry."""

    def __init__(self, handles: Sequence[int]) -> None:
        self.handles = tuple(handles)
        super().__init__(
            f"handles {list(self.handles)} repeat or are cached already: each handle names one entry"
        )


class CheckpointsRefused(Facts, ValueError):
    """An `insert` with checkpoints at `depths`: an index that keeps none (`keeps_checkpoints`
    False: attention / SWA) takes none; one that keeps them takes depths 1..`full_pages`."""

    def __init__(self, depths: Sequence[int], full_pages: int, keeps_checkpoints: bool) -> None:
        self.depths, self.full_pages, self.keeps_checkpoints = tuple(depths), full_pages, keeps_checkpoints
        if keeps_checkpoints:
            super().__init__(f"checkpoint depths {list(self.depths)} must lie in 1..{full_pages}")
        else:
            super().__init__("index built with needs_checkpoint=False (attention / SWA): pass no checkpoints")


class PagesStillHeld(Facts, RuntimeError):
    """`drop_all` while requests still hold `held` cached pages."""

    def __init__(self, held: int) -> None:
        super().__init__(f"{held} cached pages are still held by requests: release them first")
        self.held = held


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
