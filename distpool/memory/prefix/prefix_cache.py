"""A pool's prefix cache: what is cached (`PrefixIndex`, by token content) and the memory it holds
(the allocator's holds on shared pages and its checkpoint units; sharing.py).

- `match(tokens)`: the longest usable cached prefix of a prompt (never all of it);
  `branch_depth(tokens)`: the page boundary where it leaves a cached path (where a checkpoint is shared).
- `acquire(request_id, match)` / `release(request_id)`: a request reserved with a match uses its
  pages (the index will not evict them) until it is released.
- `take_checkpoint()`, then `cache_request(request_id, tokens, checkpoints)`: cache a request's full
  pages and the state checkpoints written at page boundaries; the cache holds what the index
  adopted, the request keeps its pages, and checkpoints not adopted are dropped.
- `evict(pages, checkpoints)`: give back least-recently-used entries no request uses; a page is
  freed once no request holds it either. `drop_all()` at the end of a run.
- `final_states` (a decode pool of a model with recurrent state, else None): finished requests'
  states with their partial pages (final_states.py), evicted once the index has nothing idle left.
- `report_changes()`, then `take_news()`: what was cached and evicted since the last call (decode
  sends it to the driver with its results, cache_view.py); `keys()`: every key cached now.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from distpool.memory.alloc import SharedPages
from distpool.memory.arena import require
from distpool.memory.errors import DoesNotFit, KeepsNoCheckpoints
from distpool.memory.prefix.cache_view import CacheJournal, CacheKeys, CacheNews
from distpool.memory.prefix.final_states import FinalStates
from distpool.memory.prefix.prefix_index import Handles, PrefixIndex, PrefixMatch


class PrefixCache:
    """The prefix cache of one pool, over its allocator (`SharedPages`)."""

    def __init__(self, allocator: SharedPages, page_size: int, *, needs_checkpoint: bool) -> None:
        self.allocator = allocator
        self.index = PrefixIndex(page_size, needs_checkpoint=needs_checkpoint)
        self.needs_checkpoint = needs_checkpoint
        self.users: dict[str, tuple[int, ...]] = {}  # request id -> the cached pages it acquired
        self._index_evicted = (0, 0)  # pages, checkpoints the index gave back so far
        self.final_states: FinalStates | None = None  # set by a decode pool that keeps them
        self.journal: CacheJournal | None = None  # set by `report_changes`

    def report_changes(self) -> None:
        """From now on, journal every page and final state cached and evicted (`take_news`)."""
        self.journal = self.index.journal = CacheJournal()
        if self.final_states is not None:
            self.final_states.journal = self.journal

    def take_news(self) -> CacheNews:
        """What was cached and evicted since the last call (nothing unless `report_changes`)."""
        return self.journal.take() if self.journal is not None else CacheNews()

    @property
    def has_news(self) -> bool:
        return bool(self.journal)

    def keys(self) -> CacheKeys:
        """Every key cached now: the pages' chained block keys and the final states'."""
        states = self.final_states.keys() if self.final_states is not None else frozenset()
        return CacheKeys(pages=self.index.keys(), states=states)

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        return self.index.match(tokens)

    def branch_depth(self, tokens: Sequence[int]) -> int:
        return self.index.branch_depth(tokens)

    def acquire(self, request_id: str, match: PrefixMatch) -> None:
        if match.pages:
            self.index.acquire(match)
            self.users[request_id] = match.pages

    @contextmanager
    def holding(self, match: PrefixMatch) -> Iterator[None]:
        """Keep `match`'s pages from eviction for the block (e.g. while room is made for the
        request that will reserve with it); nobody's users afterwards."""
        if not match.pages:
            yield
            return
        self.index.acquire(match)
        try:
            yield
        finally:
            self.index.release(match.pages)

    def acquire_all(self, request_ids: Sequence[str], matches: Sequence[PrefixMatch]) -> None:
        for request_id, match in zip(request_ids, matches, strict=True):
            self.acquire(request_id, match)

    def release_all(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.release(request_id)

    def release(self, request_id: str) -> None:
        pages = self.users.pop(request_id, None)
        if pages:
            self.index.release(pages)

    def insert(
        self, tokens: Sequence[int], vpages: Sequence[int], checkpoints: dict[int, int] | None
    ) -> Handles:
        """Cache the full pages of `tokens` (vpages: the request's virtual page ids) and the
        checkpoint units in `checkpoints` (depth -> virtual slot id). The caller drops the
        checkpoint units the index did not adopt (`Handles.checkpoints` lists those it did)."""
        adopted = self.index.insert(tokens, vpages, checkpoints=checkpoints)
        self.allocator.hold_pages(adopted.pages)
        return adopted

    def cache_request(
        self, request_id: str, tokens: Sequence[int], checkpoints: dict[int, int] | None = None
    ) -> Handles:
        """Cache the full pages of live request `request_id`, whose first tokens are `tokens`, and
        the checkpoint units in `checkpoints` (from `take_checkpoint`); those the index does not
        adopt (their content is cached already) are dropped."""
        table = self.allocator.holdings
        vpages = table.vpages[table.row(request_id)]
        adopted = self.insert(tokens, vpages, checkpoints)
        unused = sorted(set((checkpoints or {}).values()) - set(adopted.checkpoints))
        if unused:
            self.allocator.drop_checkpoints(unused)
        return adopted

    def take_checkpoint(self) -> tuple[int, int]:
        """A new checkpoint unit for the cache: (its handle, its physical slot id to write the state
        into). An idle checkpoint is evicted to make room if need be; raises DoesNotFit. A cache
        that keeps no checkpoints (no recurrent state, or a decode pool's) raises ValueError."""
        if not self.needs_checkpoint:
            raise KeepsNoCheckpoints()
        try:
            vid = int(self.allocator.take_checkpoints(1)[0])
        except DoesNotFit:
            if not self.evict(0, 1):
                raise
            vid = int(self.allocator.take_checkpoints(1)[0])
        return vid, self.allocator.checkpoint_slot_id(vid)

    def discard_checkpoints(self, handles: Sequence[int]) -> None:
        """Give back checkpoint units taken but never cached (a prefill that failed)."""
        if handles:
            self.allocator.drop_checkpoints(handles)

    def checkpoint_slot(self, handle: int) -> int:
        """Physical slot id of a cached checkpoint (valid until the next compaction)."""
        return self.allocator.checkpoint_slot_id(handle)

    def evict(self, pages: int, checkpoints: int = 0) -> int:
        """Evict at least `pages` pages and `checkpoints` checkpoints if that many are idle;
        returns how many entries were given back."""
        handles = self.index.evict(pages, checkpoints)
        self._give_back(handles)
        freed = (len(handles.pages), len(handles.checkpoints))
        self._index_evicted = (self._index_evicted[0] + freed[0], self._index_evicted[1] + freed[1])
        short = freed[0] < pages or freed[1] < checkpoints
        if short and self.final_states is not None and len(self.final_states):
            # Nothing idle is left to give: the least recently used state goes, with its partial page,
            # and its full pages become idle for the next call.
            return sum(freed) + sum(self.final_states.evict(1))
        return sum(freed)

    @property
    def evicted(self) -> tuple[int, int]:
        """(pages, checkpoints) given back by eviction so far, final states and their pages included
        (also those a state kept evicted to take its unit)."""
        states = self.final_states.evicted if self.final_states is not None else (0, 0)
        return self._index_evicted[0] + states[0], self._index_evicted[1] + states[1]

    def drop_all(self) -> None:
        """Give back everything (no request may still use a cached page)."""
        if self.final_states is not None:
            self.final_states.drop_all()
        self._give_back(self.index.drop_all())

    def _give_back(self, handles: Handles) -> None:
        self.allocator.drop_pages(handles.pages)
        if handles.checkpoints:
            self.allocator.drop_checkpoints(handles.checkpoints)

    def check(self) -> None:
        self.index.check(require)
        states = self.final_states
        partial, kept = (states.num_partial_pages, len(states)) if states is not None else (0, 0)
        if states is not None:
            states.check()
        cached = np.flatnonzero(self.allocator.cached)
        require(
            cached.size == self.index.num_pages + partial,
            "cache-pages",
            "the cache holds exactly the pages it indexes and its final states' partial pages",
        )
        require(
            int(np.count_nonzero(self.allocator.checkpoint)) == self.index.num_checkpoints + kept,
            "cache-checkpoints",
            "the cache owns exactly the checkpoints it indexes and its final states",
        )
