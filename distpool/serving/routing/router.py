"""Request routing: which decode worker gets a request, which prefill worker runs it.

Pure bookkeeping over worker names (no Ray here), so it is unit-tested directly. The decode side is
chosen by trying reservations in `decode_candidates` order (the worker itself knows whether it has
room); the prefill side is the live worker with the fewest requests in flight.

Decode order is least loaded first, with one exception: cache affinity. Decode workers keep a prefix
cache of finished requests in blocks of `page_size` tokens; the router mirrors it approximately (the
worker does the authoritative match) as chained block keys per worker, LRU-bounded. When a request's
prompt starts with blocks a worker is believed to hold, the longest-matching worker goes first unless
its load exceeds the least-loaded worker's by more than `AFFINITY_SLACK`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from distpool.memory.prefix import chained_block_keys

# A cache hit saves transferring part of the prompt once, but a worker with a long queue delays every
# one of the request's decode steps; past this many extra requests in flight, load order wins.
AFFINITY_SLACK = 8


class NoWorkerAlive(RuntimeError):
    """Every worker of one role is dead: nothing can be served."""


class Router:
    def __init__(
        self,
        prefill_names: list[str],
        decode_names: list[str],
        *,
        page_size: int,  # the decode pools' (PoolArgs.page_size): the router mirrors their caches
        max_blocks_per_worker: int = 1 << 17,
    ) -> None:
        if not decode_names:  # no prefill worker: colocated, each decode worker prefills its own
            raise ValueError("a deployment needs at least one decode worker")
        if page_size < 1 or max_blocks_per_worker < 1:
            raise ValueError(f"page_size ({page_size}) and max_blocks_per_worker must be >= 1")
        self.prefill_names = list(prefill_names)
        self.decode_names = list(decode_names)
        self.page_size = page_size
        self.max_blocks_per_worker = max_blocks_per_worker
        self.dead: set[str] = set()
        self.in_flight: Counter[str] = Counter()
        # Per decode worker: chained block keys, least recently remembered/matched first.
        self.cached: dict[str, OrderedDict[int, None]] = {n: OrderedDict() for n in self.decode_names}

    def alive(self, names: list[str]) -> list[str]:
        return [n for n in names if n not in self.dead]

    def pick_prefill(self) -> str:
        """The least-loaded live prefill worker (ties go to the first listed)."""
        live = self.alive(self.prefill_names)
        if not live:
            assert self.prefill_names, "a colocated deployment has no prefill worker to pick"
            raise NoWorkerAlive("every prefill worker is dead")
        return min(live, key=lambda n: self.in_flight[n])

    def _block_keys(self, tokens: Sequence[int]) -> list[int]:
        """Chained keys of the full blocks of `tokens` (`prefix_keys.chained_block_keys`). Blocks past
        the LRU bound are never kept, so they are not hashed."""
        return chained_block_keys(tokens, self.page_size, self.max_blocks_per_worker)

    def _touch(self, cache: OrderedDict[int, None], keys: list[int]) -> None:
        # Deepest first, so the shared roots end most recent: eviction then trims leaves, never a root
        # that would orphan the deeper keys of its chain.
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > self.max_blocks_per_worker:
            cache.popitem(last=False)

    @staticmethod
    def _match(cache: OrderedDict[int, None], keys: list[int]) -> int:
        for i, key in enumerate(keys):
            if key not in cache:
                return i
        return len(keys)

    def remember(self, decode_name: str, tokens: Sequence[int]) -> None:
        """Record that `decode_name` now caches every full block of `tokens` (a trailing partial block
        is not cached). Ignored for a dead worker: its cache died with it."""
        if decode_name not in self.cached:
            raise ValueError(f"{decode_name!r} is not a decode worker")
        if decode_name not in self.dead:
            self._touch(self.cached[decode_name], self._block_keys(tokens))

    def matched_blocks(self, decode_name: str, tokens: Sequence[int]) -> int:
        """How many leading full blocks of `tokens` the router believes `decode_name` caches; the
        matched blocks become the most recently used."""
        cache = self.cached.get(decode_name)
        if cache is None:
            return 0
        keys = self._block_keys(tokens)
        matched = self._match(cache, keys)
        self._touch(cache, keys[:matched])
        return matched

    def decode_candidates(
        self, avoid: set[str] = frozenset(), tokens: Sequence[int] | None = None
    ) -> list[str]:
        """Live decode workers, least loaded first; workers in `avoid` (e.g. one that just failed this
        request) go last rather than being excluded, so a single decode worker can still retry. Given
        `tokens`, the non-avoided worker caching the longest prefix of them goes first (ties: lower
        load, then listed order) unless it has over `AFFINITY_SLACK` more requests in flight than the
        least-loaded non-avoided worker."""
        live = self.alive(self.decode_names)
        if not live:
            raise NoWorkerAlive("every decode worker is dead")
        order = sorted(live, key=lambda n: (n in avoid, self.in_flight[n]))
        if tokens is None or order[0] in avoid:
            return order
        keys = self._block_keys(tokens)
        best, best_match = order[0], 0
        for name in order:  # load order, so the first of the longest matches has the lowest load
            if name in avoid:
                break
            matched = self._match(self.cached[name], keys)
            if matched > best_match:
                best, best_match = name, matched
        if best_match == 0 or self.in_flight[best] - self.in_flight[order[0]] > AFFINITY_SLACK:
            return order
        self._touch(self.cached[best], keys[:best_match])
        return [best] + [n for n in order if n != best]

    def begin(self, *names: str) -> None:
        for n in names:
            self.in_flight[n] += 1

    def end(self, *names: str) -> None:
        for n in names:
            assert self.in_flight[n] > 0, f"{n} has no request in flight"
            self.in_flight[n] -= 1

    def mark_dead(self, name: str) -> None:
        """The worker is gone; a decode worker's cached view goes with it (a restart starts empty)."""
        self.dead.add(name)
        if name in self.cached:
            self.cached[name].clear()

    def revive(self, name: str) -> None:
        """A restarted worker serves again (requests still counted on it end as they fail)."""
        self.dead.discard(name)
