"""Request routing: which decode worker gets a request, which prefill worker runs it.

Pure bookkeeping over worker names (no Ray here), so it is unit-tested directly. The decode side is
chosen by trying reservations in `decode_candidates` order (the worker itself knows whether it has
room); the prefill side is the live worker with the fewest requests in flight.

Decode order is least loaded first, with one exception: cache affinity. Decode workers keep a prefix
cache of finished requests in blocks of `page_size` tokens, and report what they cached and evicted
with their results; the router applies each report to its view of that worker's cache
(`views`, chained block keys: `memory.prefix.cache_view`), which then equals the worker's own. When a
request's prompt starts with blocks a worker holds, the longest-matching worker goes first unless
its load exceeds the least-loaded worker's by more than `AFFINITY_SLACK`. The same views tell the
conditional policy which worker keeps the state a prompt extends (`serving.routing.conditional`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from distpool.facts import Facts
from distpool.memory.prefix import CacheNews, CacheView, chained_block_keys

# A cache hit saves transferring part of the prompt once, but a worker with a long queue delays every
# one of the request's decode steps; past this many extra requests in flight, load order wins.
AFFINITY_SLACK = 8


class NoWorkerAlive(Facts, RuntimeError):
    """Every worker of `role` ("prefill" or "decode") is dead: nothing can be served."""

    def __init__(self, role: str) -> None:
        super().__init__(f"every {role} worker is dead")
        self.role = role


class RouterArgInvalid(Facts, ValueError):
    """A router given `value` for `field` (a constructor argument, or the worker a call names), which
    must be `expected`."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        super().__init__(f"{field} must be {expected}; got {value!r}")
        self.field, self.value, self.expected = field, value, expected


class Router:
    def __init__(
        self,
        prefill_names: list[str],
        decode_names: list[str],
        *,
        page_size: int,  # the decode pools' (PoolArgs.page_size): a cache view's block
    ) -> None:
        if not decode_names:  # no prefill worker: colocated, each decode worker prefills its own
            raise RouterArgInvalid("decode_names", decode_names, "at least one decode worker")
        if page_size < 1:
            raise RouterArgInvalid("page_size", page_size, ">= 1")
        self.prefill_names = list(prefill_names)
        self.decode_names = list(decode_names)
        self.page_size = page_size
        self.dead: set[str] = set()
        self.in_flight: Counter[str] = Counter()
        # Per decode worker: its cache's keys, as its reports left them.
        self.views: dict[str, CacheView] = {n: CacheView(page_size) for n in self.decode_names}

    def alive(self, names: list[str]) -> list[str]:
        return [n for n in names if n not in self.dead]

    def pick_prefill(self) -> str:
        """The least-loaded live prefill worker (ties go to the first listed)."""
        live = self.alive(self.prefill_names)
        if not live:
            if not self.prefill_names:
                raise RuntimeError("a colocated deployment has no prefill worker to pick")
            raise NoWorkerAlive("prefill")
        return min(live, key=lambda n: self.in_flight[n])

    def learned(self, decode_name: str, news: CacheNews) -> None:
        """`decode_name` reported what its cache cached and evicted since its last report (with its
        results): its view follows. Ignored for a dead worker: its cache died with it."""
        if decode_name not in self.views:
            raise RouterArgInvalid("decode_name", decode_name, "a decode worker")
        if decode_name not in self.dead:
            self.views[decode_name].apply(news)

    def matched_blocks(self, decode_name: str, tokens: Sequence[int]) -> int:
        """How many leading full blocks of `tokens` `decode_name` caches."""
        view = self.views.get(decode_name)
        return view.matched_blocks(chained_block_keys(tokens, self.page_size)) if view is not None else 0

    def decode_candidates(
        self,
        avoid: set[str] = frozenset(),
        tokens: Sequence[int] | None = None,
        *,
        keys: Sequence[bytes] | None = None,
    ) -> list[str]:
        """Live decode workers, least loaded first; workers in `avoid` (e.g. one that just failed this
        request) go last rather than being excluded, so a single decode worker can still retry. Given
        `tokens` (or their `chained_block_keys` in blocks of `page_size`, `keys`), the non-avoided
        worker caching the longest prefix of them goes first (ties: lower load, then listed order)
        unless it has over `AFFINITY_SLACK` more requests in flight than the least-loaded
        non-avoided worker."""
        live = self.alive(self.decode_names)
        if not live:
            raise NoWorkerAlive("decode")
        order = sorted(live, key=lambda n: (n in avoid, self.in_flight[n]))
        if (tokens is None and keys is None) or order[0] in avoid:
            return order
        keys = chained_block_keys(tokens, self.page_size) if keys is None else keys
        best, best_match = order[0], 0
        for name in order:  # load order, so the first of the longest matches has the lowest load
            if name in avoid:
                break
            matched = self.views[name].matched_blocks(keys)
            if matched > best_match:
                best, best_match = name, matched
        if best_match == 0 or self.in_flight[best] - self.in_flight[order[0]] > AFFINITY_SLACK:
            return order
        return [best] + [n for n in order if n != best]

    def begin(self, *names: str) -> None:
        for n in names:
            self.in_flight[n] += 1

    def end(self, *names: str) -> None:
        for n in names:
            if self.in_flight[n] <= 0:
                raise RuntimeError(f"{n} has no request in flight")
            self.in_flight[n] -= 1

    def mark_dead(self, name: str) -> None:
        """The worker is gone; a decode worker's cache view goes with it (a restart starts empty)."""
        self.dead.add(name)
        if name in self.views:
            self.views[name].clear()

    def revive(self, name: str) -> None:
        """A restarted worker serves again (requests still counted on it end as they fail)."""
        self.dead.discard(name)
