"""What a pool does when the allocator refuses a call for want of room, before it gives up.

Two answers, outermost first: evict idle cached prefixes (prefix_cache.py) while something is
evictable, then, where the caller allows it, compact, cheapest plan first. A `NeedsCompaction` that
is not allowed to compact goes straight back to the caller: eviction does not answer it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from distpool.memory.errors import DoesNotFit, NeedsCompaction
from distpool.memory.prefix import PrefixCache


def evicting_if(
    attempt: Callable[[], None],
    cache: PrefixCache | None,
    requests: Sequence[tuple[str, int]],
    low_units: int,
    pages_for: Callable[[int], int],
) -> None:
    """`attempt()`, evicting idle cached prefixes (as many pages as the requests' tokens fill,
    and `low_units` checkpoints, at a time) while it is refused for want of room and something
    is evictable. `pages_for`: the pages a request of n tokens holds."""
    while True:
        try:
            return attempt()
        except NeedsCompaction:
            raise
        except DoesNotFit:
            pages = max(sum(pages_for(n) for _, n in requests), 1)
            if cache is None or not cache.evict(pages, low_units):
                raise


def compacting_if(
    compact: bool, take: Callable[..., None], requests: Sequence, compact_bands: Callable[..., int]
) -> None:
    """`take(requests, whole=...)`, compacting when refused with `NeedsCompaction` and allowed.
    `compact_bands(keep_room=..., need=...)`: `ArenaPool.compact`.

    Cheapest first: what is in the way moves, keeping every request's growth room; then the
    same without the room. Until then `whole` asks the allocator to refuse a request that would
    scatter when clearing a run for it costs less (move_cost.py). Then the call takes what
    there is, scattered if need be; only when it still does not fit comes the full compaction
    the refusal promised room after."""
    try:
        return take(requests, whole=compact)
    except NeedsCompaction as needs:
        if not compact:
            raise
        need = needs
    for keep_room in (True, False):
        compact_bands(keep_room=keep_room, need=need)
        try:
            return take(requests, whole=True)
        except NeedsCompaction as needs:
            need = needs
    try:
        return take(requests, whole=False)
    except NeedsCompaction:
        compact_bands()
        return take(requests, whole=False)
