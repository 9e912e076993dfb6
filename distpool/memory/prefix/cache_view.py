"""Decode's cache keys as the driver sees them: decode journals what its prefix cache cached and
evicted (`CacheJournal`), hands the journal out with the results it sends (`CacheNews`), and the
driver applies it to its copy (`CacheView`), so that the copy equals decode's keys (`CacheKeys`)
after every result.

    decode:  index inserts / evicts a page  ─┐
             final states keep / drop one   ─┴─> CacheJournal ──take()──> CacheNews ──> driver
    driver:  CacheView.apply(news)  ==  decode's PrefixCache.keys()

A journal keeps, per key, only whether it is cached now (the last thing that happened to it since
the last report): news lists each key once, and applying it in any order gives decode's keys.

Reports are numbered; a view knows the last it applied. A refusal for a state that is gone is then
told apart: its drop went out in a report the driver had applied when it chose (its view was stale:
a bug) or it had not reached the driver yet (news in flight: the one delay a report has).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from distpool.memory.prefix.block_keys import ROOT_KEY, StateKey, chained_block_keys, tail_key


@dataclass(frozen=True)
class CacheKeys:
    """Every key a decode worker's prefix cache holds: its cached full pages (the chained key of the
    prefix through each) and its kept final states."""

    pages: frozenset[bytes] = frozenset()
    states: frozenset[StateKey] = frozenset()


@dataclass(frozen=True)
class CacheNews:
    """What a decode worker's cache changed since its last report, each key once."""

    cached_pages: tuple[bytes, ...] = ()
    evicted_pages: tuple[bytes, ...] = ()
    kept_states: tuple[StateKey, ...] = ()
    dropped_states: tuple[StateKey, ...] = ()
    report: int = 0  # its number among the worker's reports, from 1 (0: no report, nothing changed)

    def __bool__(self) -> bool:
        return bool(self.cached_pages or self.evicted_pages or self.kept_states or self.dropped_states)


# Dropped states whose report number a journal remembers (a refusal asks for one): the newest.
REMEMBERED_DROPS = 4096


class CacheJournal:
    """Decode's side: whether each key that changed since the last `take` is cached now."""

    def __init__(self) -> None:
        self._pages: dict[bytes, bool] = {}
        self._states: dict[StateKey, bool] = {}
        self.reports = 0  # reports taken so far (those with news)
        self._dropped_in: OrderedDict[StateKey, int] = OrderedDict()  # state -> the report that said so

    def __bool__(self) -> bool:
        return bool(self._pages or self._states)

    def page(self, key: bytes, *, cached: bool) -> None:
        self._pages[key] = cached

    def state(self, key: StateKey, *, kept: bool) -> None:
        self._states[key] = kept

    def take(self) -> CacheNews:
        """The news since the last `take`, numbered; the journal starts empty again."""
        if not self:
            return CacheNews()
        pages, states, self._pages, self._states = self._pages, self._states, {}, {}
        self.reports += 1
        for key, kept in states.items():
            self._dropped_in.pop(key, None)
            if not kept:
                self._dropped_in[key] = self.reports
        while len(self._dropped_in) > REMEMBERED_DROPS:
            self._dropped_in.popitem(last=False)
        return CacheNews(
            cached_pages=tuple(k for k, cached in pages.items() if cached),
            evicted_pages=tuple(k for k, cached in pages.items() if not cached),
            kept_states=tuple(k for k, kept in states.items() if kept),
            dropped_states=tuple(k for k, kept in states.items() if not kept),
            report=self.reports,
        )

    def drop_reported(self, key: StateKey, seen: int) -> bool:
        """Whether state `key`, gone, was reported gone in one of the first `seen` reports (or was
        never kept since the newest REMEMBERED_DROPS drops): False while its drop is unreported or
        in a later report."""
        if self._states.get(key) is False:
            return False
        report = self._dropped_in.get(key)
        return report is None or report <= seen


class CacheView:
    """The driver's copy of one decode worker's cache keys, kept equal by `apply`ing its news."""

    def __init__(self, block: int) -> None:
        if block < 1:
            raise ValueError(f"a block holds at least one token; got {block}")
        self.block = block
        self.pages: set[bytes] = set()
        self.report = 0  # the last report applied
        # blocks_key -> num_tokens -> key -> state: states of equal full blocks and length differ
        # in their partial block alone
        self._states: dict[bytes, dict[int, dict[bytes, StateKey]]] = {}

    def apply(self, news: CacheNews) -> None:
        self.report = news.report or self.report
        self.pages.difference_update(news.evicted_pages)
        self.pages.update(news.cached_pages)
        for state in news.dropped_states:
            filed = self._states.get(state.blocks_key, {})
            same_length = filed.get(state.num_tokens, {})
            if same_length.pop(state.key, None) is not None and not same_length:
                del filed[state.num_tokens]
                if not filed:
                    del self._states[state.blocks_key]
        for state in news.kept_states:
            self._states.setdefault(state.blocks_key, {}).setdefault(state.num_tokens, {})[state.key] = state

    def clear(self) -> None:
        """The worker is gone: its cache with it."""
        self.pages.clear()
        self._states.clear()
        self.report = 0  # a restarted worker numbers its reports anew

    def keys(self) -> CacheKeys:
        states = frozenset(
            s
            for filed in self._states.values()
            for same_length in filed.values()
            for s in same_length.values()
        )
        return CacheKeys(pages=frozenset(self.pages), states=states)

    def matched_blocks(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its `chained_block_keys`) are cached."""
        for i, key in enumerate(keys):
            if key not in self.pages:
                return i
        return len(keys)

    def state_chain(self, prompt: Sequence[int], keys: Sequence[bytes] | None = None) -> list[bytes]:
        """The keys `longest_state` looks `prompt` up by (the same for every view of one block);
        `keys`: the prompt's `chained_block_keys`, if known."""
        count = max(len(prompt) - 1, 0) // self.block
        return [ROOT_KEY, *(chained_block_keys(prompt, self.block, count) if keys is None else keys[:count])]

    def longest_state(self, prompt: Sequence[int], chain: Sequence[bytes] | None = None) -> int | None:
        """The tokens of the longest kept state whose tokens are a proper prefix of `prompt` (None:
        no such state). One key per block of the prompt (`chain`: `state_chain(prompt)`, if known),
        and one more per candidate state."""
        if not self._states or len(prompt) < 2:
            return None
        chain = self.state_chain(prompt) if chain is None else chain
        for blocks in reversed(range(len(chain))):  # deepest first: the longest state wins
            filed = self._states.get(chain[blocks], {})
            for num_tokens in sorted(filed, reverse=True):
                if num_tokens < len(prompt) and num_tokens // self.block == blocks:
                    if tail_key(chain[blocks], prompt[:num_tokens], self.block) in filed[num_tokens]:
                        return num_tokens
        return None
