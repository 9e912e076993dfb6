"""Decode's final states: what a finished request leaves behind so that its next turn can be prefilled
where it decoded, from its state, instead of moving a whole slot again.

A request that finished after n tokens with KV (its prompt and its reply but the last sampled token,
which was never fed) leaves, per entry:

    tokens     [0 ............................ full * page_size) [ ...... n)
    KV         full pages: the prefix index's pages of these     the partial page: its own,
               tokens, acquired by the entry (kept while it is)  held by the cache (never in the index)
    state      one checkpoint unit (a slot's bytes): the recurrent state after exactly n tokens

The partial page travels with the state because its KV cannot be recomputed from the state; the full
pages are acquired so that the index never evicts what the state needs. Entries are evicted whole,
least recently used first, once the index has no idle page left to give (a state saves a slot's
transfer, a loose page only its own bytes). A conversation keeps one entry: its latest, which
supersedes the states of its earlier turns. Entries are filed by their tokens' prefixes
(`prefix_keys.py`), so a lookup hashes the prompt once; each is known to the driver by its
`StateKey` (`block_keys.py`), which a `CacheJournal`, when set, hears of as it is kept and dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from distpool.memory.alloc import Allocator
from distpool.memory.arena import Arena, require
from distpool.memory.errors import DoesNotFit
from distpool.memory.prefix.block_keys import StateKey
from distpool.memory.prefix.cache_view import CacheJournal
from distpool.memory.prefix.prefix_index import PrefixIndex, PrefixMatch
from distpool.memory.prefix.prefix_keys import PrefixKeys


@dataclass(frozen=True)
class FinalState:
    """One kept state: the state after exactly `tokens`, with the KV of those tokens."""

    tokens: tuple[int, ...]
    pages: tuple[int, ...]  # the index's page handles of the full pages (acquired by this entry)
    partial_page: int | None  # virtual page holding the last len(tokens) % page_size tokens (cache-held)
    checkpoint: int  # virtual low unit holding the state
    key: StateKey  # what the driver knows it by

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def prefix_match(self, page_size: int) -> PrefixMatch:
        """The match a request continuing this state reserves with: its full pages, shared."""
        return PrefixMatch(pages=self.pages, num_tokens=len(self.pages) * page_size)


class FinalStates:
    """The final states a decode pool keeps, LRU, over its allocator, arena and prefix index."""

    def __init__(self, allocator: Allocator, arena: Arena, index: PrefixIndex, page_size: int) -> None:
        self.allocator, self.arena, self.index, self.page_size = allocator, arena, index, page_size
        self._entries: PrefixKeys[FinalState] = PrefixKeys(page_size)  # least recent first
        self.kept = 0  # entries kept so far (the run's count; `len` is what is held now)
        self.evicted = (0, 0)  # (partial pages, states) given back to make room so far
        self.journal: CacheJournal | None = None  # hears of every state kept and dropped, when set

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> frozenset[StateKey]:
        return frozenset(entry.key for entry in self._entries.values())

    @property
    def num_partial_pages(self) -> int:
        return sum(e.partial_page is not None for e in self._entries.values())

    def keep(self, request_id: str, tokens: Sequence[int]) -> bool:
        """Keep live request `request_id`'s state, after exactly `tokens` (every token it holds KV
        for; its full pages cached in the index already). Whether it was kept: not when its full
        pages are not all cached (a digest collision) or no low unit is free even after evicting
        older states."""
        key = tuple(int(t) for t in tokens)
        full = len(key) // self.page_size
        pages = self.index.cached_path(key)
        if len(pages) != full or not key:
            return False
        for older in self._entries.prefixes_of(key, proper=False):  # this conversation's earlier turns
            self._drop(self._entries.pop(older))
        vid = self._take_unit()
        if vid is None:
            return False
        slot = self.allocator.slot_id(request_id)
        if slot is None:
            raise ValueError("a final state is kept only for a model with recurrent state")
        self._copy(self._slot_row(slot), self._slot_row(self.allocator.checkpoint_slot_id(vid)))
        partial = None
        if len(key) % self.page_size:
            table = self.allocator.holdings
            partial = int(table.vpages[table.row(request_id)][full])
            self.allocator.hold_pages([partial])
        if pages:
            self.index.acquire(PrefixMatch(pages=pages, num_tokens=full * self.page_size))
        state_key = StateKey.of(key, self.page_size)
        entry = FinalState(tokens=key, pages=pages, partial_page=partial, checkpoint=vid, key=state_key)
        self._entries.add(key, entry)
        if self.journal is not None:
            self.journal.state(state_key, kept=True)
        self.kept += 1
        return True

    def find(self, prompt: Sequence[int]) -> FinalState | None:
        """The longest kept state whose tokens are a proper prefix of `prompt` (read-only)."""
        found = self._entries.longest_proper_prefix(prompt)
        return found[1] if found is not None else None

    def restore(self, entry: FinalState, request_id: str) -> None:
        """Copy `entry`'s state into live request `request_id`'s slot and its partial page into the
        request's own page at that position. The request was reserved with `entry.prefix_match`;
        it now holds the KV and the state of `entry.tokens`. Marks the entry most recently used."""
        self._entries.touch(entry.tokens)
        slot = self.allocator.slot_id(request_id)
        if slot is None:
            raise ValueError("a final state is restored only for a model with recurrent state")
        self._copy(self._slot_row(self.allocator.checkpoint_slot_id(entry.checkpoint)), self._slot_row(slot))
        if entry.partial_page is not None:
            src = int(self.allocator.high_band.physical(np.array([entry.partial_page]))[0])
            dst = int(self.allocator.page_ids(request_id)[len(entry.pages)])
            self._copy(self._page_row(src), self._page_row(dst))

    def evict(self, count: int = 1) -> tuple[int, int]:
        """Give back the `count` least recently used entries (fewer if there are fewer); returns
        (pages, checkpoints) given back by the cache (the full pages only become idle in the index)."""
        pages = checkpoints = 0
        for _ in range(min(count, len(self._entries))):
            entry = self._entries.pop_oldest()
            self._drop(entry)
            pages += entry.partial_page is not None
            checkpoints += 1
        self.evicted = (self.evicted[0] + pages, self.evicted[1] + checkpoints)
        return pages, checkpoints

    def drop_all(self) -> None:
        while self._entries:
            self._drop(self._entries.pop_oldest())

    def check(self) -> None:
        for entry in self._entries.values():
            require(
                bool(self.allocator.checkpoint[entry.checkpoint]),
                "final-checkpoint",
                "a final state's unit is a checkpoint",
            )
            require(
                len(entry.pages) == entry.num_tokens // self.page_size,
                "final-pages",
                "a final state covers its pages",
            )
            if entry.partial_page is not None:
                require(
                    bool(self.allocator.cached[entry.partial_page]),
                    "final-partial",
                    "a final state holds its partial page",
                )

    # ---- internals ------------------------------------------------------------------------------
    def _take_unit(self) -> int | None:
        """A free low unit for a state, evicting the least recently used states if need be."""
        while True:
            try:
                return int(self.allocator.take_checkpoints(1)[0])
            except DoesNotFit:
                if not self._entries:
                    return None
                self.evict(1)

    def _drop(self, entry: FinalState) -> None:
        if self.journal is not None:
            self.journal.state(entry.key, kept=False)
        if entry.pages:
            self.index.release(entry.pages)
        if entry.partial_page is not None:
            self.allocator.drop_pages([entry.partial_page])
        self.allocator.drop_checkpoints([entry.checkpoint])

    def _slot_row(self, slot: int) -> list[int]:
        """(offset, nbytes) of physical slot `slot` in the arena."""
        empty = torch.empty(0, dtype=torch.int64)
        return self.arena.byte_ranges(slot, empty, empty)[0].tolist()

    def _page_row(self, page: int) -> list[int]:
        """(offset, nbytes) of physical page `page` in the arena."""
        return self.arena.byte_ranges(None, torch.tensor([page]), torch.empty(0, dtype=torch.int64))[
            0
        ].tolist()

    def _copy(self, src: list[int], dst: list[int]) -> None:
        (src_at, nbytes), (dst_at, _) = src, dst
        self.arena.copy_runs(np.array([[src_at, dst_at, nbytes]], dtype=np.int64))
