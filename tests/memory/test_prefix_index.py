"""Prefix index: matching by page content, checkpoint cut-back, reference counts and LRU eviction.

Scenarios assert exact handles; a state machine runs random inserts (a two-letter alphabet, so
prefixes collide often), matches, acquires, releases, evictions and drops against a dict-of-prefixes
model, with `check()` after every step.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from distpool.memory.errors import (
    CheckpointsRefused,
    HandlesReused,
    NotACachedPrefix,
    NotAcquired,
    PagesStillHeld,
    StaleMatch,
)
from distpool.memory.prefix import prefix_index
from distpool.memory.prefix.prefix_index import Handles, PrefixIndex, PrefixMatch


def make_index(page_size: int = 2, *, needs_checkpoint: bool = False) -> PrefixIndex:
    return PrefixIndex(page_size, needs_checkpoint=needs_checkpoint)


def cached(index: PrefixIndex, tokens: list[int], first_handle: int, **checkpoints: int) -> Handles:
    """Insert `tokens` with page handles first_handle, first_handle + 1, ...; checkpoints as d<k>=handle."""
    pages = list(range(first_handle, first_handle + len(tokens) // index.page_size + 1))
    adopted = index.insert(tokens, pages, checkpoints={int(k[1:]): h for k, h in checkpoints.items()})
    index.check()
    return adopted


def test_shared_prefixes_match_up_to_the_last_common_full_page():
    index = make_index()
    assert cached(index, [1, 2, 3, 4, 5, 6, 7], 10) == Handles(pages=(10, 11, 12))  # 7: partial page
    assert index.match([1, 2, 3, 4, 9, 9, 9]) == PrefixMatch(pages=(10, 11), num_tokens=4)
    assert index.match([1, 2, 3, 9, 5, 6, 7]).pages == (10,)  # a different token in page 2
    assert index.match([9, 2, 3, 4, 5, 6, 7]).pages == ()
    assert index.match([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 6  # page [7, 8] was never cached
    assert index.match([1, 2, 3]).pages == (10,)  # the partial page [3] never matches


def test_branch_depth_is_where_a_prompt_leaves_a_cached_path():
    index = make_index(needs_checkpoint=True)  # page size 2; no checkpoint is needed to branch
    cached(index, [1, 2, 3, 4, 5, 6, 7, 8], 10)  # pages [1 2] [3 4] [5 6] [7 8]
    assert index.branch_depth([1, 2, 3, 4, 9, 9, 9]) == 2  # leaves the cached path after 2 pages
    assert index.branch_depth([1, 2, 9, 9]) == 1
    assert index.branch_depth([9, 2, 3, 4]) == 0  # shares nothing
    assert index.branch_depth([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9]) == 0  # extends a cached prompt
    assert index.branch_depth([1, 2, 3, 4, 5, 6, 7, 8]) == 3  # the same prompt: all but its last page
    assert index.branch_depth([1, 2, 3, 4, 5]) == 2  # a prefix of a cached prompt, all of it usable
    assert index.match([1, 2, 3, 4, 9]).pages == ()  # read-only, and no checkpoint to match yet
    index.check()


def test_the_whole_prompt_is_never_matched():
    index = make_index()
    cached(index, [1, 2, 3, 4], 10)
    assert index.match([1, 2, 3, 4]).pages == (10,)  # exactly two pages: one token must be computed
    assert index.match([1, 2, 3, 4, 5]).pages == (10, 11)
    assert index.match([1, 2]).pages == () and index.match([]).pages == ()


def test_hybrid_mamba_matches_only_up_to_the_deepest_checkpoint():
    index = make_index(needs_checkpoint=True)
    assert cached(index, [1, 2, 3, 4, 5, 6, 7, 8], 10, d1=100, d3=300) == Handles(
        pages=(10, 11, 12, 13), checkpoints=(100, 300)
    )
    deepest = PrefixMatch(pages=(10, 11, 12), num_tokens=6, checkpoint=300)
    assert index.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == deepest
    assert index.match([1, 2, 3, 4, 5, 9]) == PrefixMatch(pages=(10,), num_tokens=2, checkpoint=100)
    assert index.match([1, 2, 3]) == PrefixMatch(pages=(10,), num_tokens=2, checkpoint=100)
    assert index.match([1, 2]).pages == ()  # no checkpoint within reach
    index.acquire(deepest)
    assert cached(index, [1, 2, 3, 4], 20, d2=200) == Handles(checkpoints=(200,))
    assert index.evictable() == (1, 0)  # page 13; checkpoint 200 sits on held page 11
    with pytest.raises(CheckpointsRefused) as refused:
        make_index().insert([1, 2], [0], checkpoints={1: 5})
    assert not refused.value.keeps_checkpoints
    with pytest.raises(CheckpointsRefused) as refused:
        index.insert([1, 2, 3], [0, 1], checkpoints={2: 5})
    assert (refused.value.depths, refused.value.full_pages, refused.value.keeps_checkpoints) == (
        (2,),
        1,
        True,
    )


def test_inserting_a_cached_prefix_adopts_nothing_but_new_pages_and_missing_checkpoints():
    index = make_index(needs_checkpoint=True)
    cached(index, [1, 2, 3, 4], 10, d2=200)
    assert cached(index, [1, 2, 3, 4], 20, d2=201) == Handles()  # same content: caller keeps 20, 21, 201
    assert cached(index, [1, 2, 3, 4, 5, 6], 30, d1=101, d3=301) == Handles(
        pages=(32,), checkpoints=(101, 301)
    )
    assert cached(index, [1, 2, 3, 4, 5, 6], 10) == Handles()  # the cached handles handed back
    assert (len(index), index.num_pages, index.num_checkpoints) == (3, 3, 3)
    with pytest.raises(HandlesReused) as reused:
        index.insert([7, 7, 8, 8], [10, 40])  # handle 10 already names page [1, 2]
    assert reused.value.handles == (10, 40)
    with pytest.raises(HandlesReused) as reused:
        index.insert([7, 7, 8, 8], [40, 40])
    assert reused.value.handles == (40, 40)
    index.check()


def test_eviction_takes_least_recently_used_leaves_first_with_their_checkpoints():
    index = make_index(needs_checkpoint=True)
    cached(index, [1, 1, 2, 2], 10, d2=100)  # tick 1: 10 -> 11*
    cached(index, [1, 1, 3, 3], 20, d1=101, d2=200)  # tick 2: 10* -> 21*
    cached(index, [4, 4], 30, d1=300)  # tick 3: 30*
    assert index.evictable() == (4, 4)
    assert index.evict(1) == Handles(pages=(11,), checkpoints=(100,))  # oldest leaf
    assert index.evict(2) == Handles(pages=(21, 10), checkpoints=(200, 101))  # leaf, then its parent
    index.acquire(index.match([4, 4, 0]))  # stamps 30
    assert index.evict(5) == Handles()  # held: nothing evictable
    index.release([30])
    assert index.evict(5) == Handles(pages=(30,), checkpoints=(300,)) and len(index) == 0
    index.check()


def test_a_release_counts_as_a_use():
    index = make_index()
    cached(index, [1, 1], 10)
    match = index.match([1, 1, 0])
    index.acquire(match)
    cached(index, [2, 2], 20)
    index.release(match.pages)  # 10 was used after 20 was inserted
    for _ in range(500):  # each release queues a heap entry: stale ones are pruned, not piled up
        index.acquire(match)
        index.release(match.pages)
    assert len(index._heaps[True]) <= 2 * len(index) + 65
    assert index.evict(1) == Handles(pages=(20,))


def test_checkpoints_alone_go_least_recently_used_first_when_only_checkpoints_are_wanted():
    index = make_index(needs_checkpoint=True)
    cached(index, [1, 1, 2, 2, 3, 3], 10, d1=100, d2=110, d3=120)  # one tick: deeper goes first
    cached(index, [5, 5], 50, d1=500)
    assert index.evict(0, 2) == Handles(checkpoints=(120, 110))
    assert len(index) == 4 and index.match([1, 1, 2, 2, 3, 3, 0]).pages == (10,)
    assert index.evict(1, 3) == Handles(pages=(12,), checkpoints=(100, 500))  # page first, then alone
    assert index.evictable() == (3, 0)


def test_users_block_eviction_and_drop_all_until_released():
    index = make_index()
    cached(index, [1, 1, 2, 2, 3], 10)
    cached(index, [1, 1, 5, 5, 3], 20)
    match = index.match([1, 1, 2, 2, 3])
    index.acquire(match)
    index.acquire(index.match([1, 1, 9]))
    index.check()
    assert index.evictable() == (1, 0)
    assert index.evict(3) == Handles(pages=(21,))  # 10 and 11 are held
    with pytest.raises(PagesStillHeld) as still_held:
        index.drop_all()
    assert still_held.value.held == 2
    index.release(match.pages)
    index.release([10])
    with pytest.raises(NotAcquired) as not_acquired:
        index.release([10])  # once too often
    assert not_acquired.value.pages == (10,)
    index.acquire(match)
    with pytest.raises(NotAcquired):
        index.release([10])  # the holder of 10, 11 releases both: 11 must never outnumber 10
    index.release(match.pages)
    with pytest.raises(NotACachedPrefix) as not_cached:
        index.release([11])  # not a path from the root
    assert (not_cached.value.pages, not_cached.value.page) == ((11,), 11)
    assert index.drop_all() == Handles(pages=(10, 11)) and len(index) == 0
    index.check()


def test_a_stale_match_is_refused():
    index = make_index(needs_checkpoint=True)
    cached(index, [1, 1, 2, 2], 10, d1=100)
    match = index.match([1, 1, 2])
    index.evict(0, 1)
    with pytest.raises(StaleMatch) as stale:
        index.acquire(match)
    assert stale.value.match == match
    index.evict(2)
    with pytest.raises(NotACachedPrefix) as not_cached:
        index.acquire(match)
    assert (not_cached.value.pages, not_cached.value.page) == (match.pages, match.pages[0])


def test_a_digest_collision_loses_a_hit_but_never_gives_a_wrong_match(monkeypatch):
    monkeypatch.setattr(prefix_index, "block_key", lambda parent, page: parent[:4])  # all siblings collide
    index = make_index()
    assert cached(index, [1, 1, 2, 2], 10) == Handles(pages=(10, 11))
    assert cached(index, [3, 3, 4, 4], 20) == Handles()  # its digest is taken: nothing cached
    assert index.match([3, 3, 4, 4, 5]).pages == () and index.match([1, 1, 2, 2, 5]).pages == (10, 11)
    assert cached(index, [1, 1, 5, 5], 30) == Handles()


TOKENS = st.lists(st.integers(0, 1), max_size=9)


class PrefixMachine(RuleBasedStateMachine):
    """The model: prefix tuple -> page handle / checkpoint handle / users / tick of its last use."""

    @initialize(page_size=st.integers(1, 3), needs_checkpoint=st.booleans())
    def build(self, page_size: int, needs_checkpoint: bool) -> None:
        self.index = make_index(page_size, needs_checkpoint=needs_checkpoint)
        self.page: dict[tuple[int, ...], int] = {}
        self.checkpoint: dict[tuple[int, ...], int] = {}
        self.users: dict[tuple[int, ...], int] = {}
        self.tick: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.handles = itertools.count()  # one counter for pages and checkpoints: all distinct
        self.held: list[tuple[tuple[int, ...], ...]] = []  # the prefixes each holder acquired
        self.adopted: set[int] = set()
        self.returned: set[int] = set()

    def _prefixes(self, tokens: list[int], num_pages: int) -> list[tuple[int, ...]]:
        return [tuple(tokens[: (k + 1) * self.index.page_size]) for k in range(num_pages)]

    def _stamp(self, prefixes: list[tuple[int, ...]], users: int) -> None:
        self.clock += 1
        for prefix in prefixes:
            self.users[prefix] += users
            self.tick[prefix] = self.clock

    def _give_back(self, handles: Handles) -> None:
        given = [*handles.pages, *handles.checkpoints]
        assert len(set(given)) == len(given) and not set(given) & self.returned
        self.returned |= set(given)

    @rule(tokens=TOKENS, depths=st.sets(st.integers(1, 9)), reuse=st.booleans())
    def insert(self, tokens: list[int], depths: set[int], reuse: bool) -> None:
        prefixes = self._prefixes(tokens, len(tokens) // self.index.page_size)
        pages = [self.page[p] if reuse and p in self.page else next(self.handles) for p in prefixes]
        pages.append(next(self.handles))  # the partial last page, never cached
        checkpoints = {k: next(self.handles) for k in depths if k <= len(prefixes)}
        if not self.index.needs_checkpoint:
            checkpoints = {}
        adopted = self.index.insert(tokens, pages, checkpoints=checkpoints)
        new = [k for k, p in enumerate(prefixes) if p not in self.page]
        new_checkpoints = [k for k in sorted(checkpoints) if prefixes[k - 1] not in self.checkpoint]
        assert adopted == Handles(
            pages=tuple(pages[k] for k in new), checkpoints=tuple(checkpoints[k] for k in new_checkpoints)
        )
        for k in new:
            self.page[prefixes[k]], self.users[prefixes[k]] = pages[k], 0
        for k in new_checkpoints:
            self.checkpoint[prefixes[k - 1]] = checkpoints[k]
        self._stamp(prefixes, 0)
        self.adopted |= {*adopted.pages, *adopted.checkpoints}

    @rule(tokens=TOKENS, hold=st.booleans())
    def match(self, tokens: list[int], hold: bool) -> None:
        prefixes = self._prefixes(tokens, max(len(tokens) - 1, 0) // self.index.page_size)
        depth = next((k for k, p in enumerate(prefixes) if p not in self.page), len(prefixes))
        while self.index.needs_checkpoint and depth and prefixes[depth - 1] not in self.checkpoint:
            depth -= 1
        checkpoint = self.checkpoint[prefixes[depth - 1]] if depth and self.index.needs_checkpoint else None
        match = self.index.match(tokens)
        num_tokens = depth * self.index.page_size
        pages = tuple(self.page[p] for p in prefixes[:depth])
        assert match == PrefixMatch(pages=pages, num_tokens=num_tokens, checkpoint=checkpoint)
        assert num_tokens < len(tokens) or not pages
        if hold:
            self.index.acquire(match)
            self._stamp(prefixes[:depth], 1)
            self.held += [tuple(prefixes[:depth])] if depth else []  # an empty match holds nothing

    @precondition(lambda self: self.held)
    @rule(which=st.integers(0, 100))
    def release(self, which: int) -> None:
        prefixes = list(self.held.pop(which % len(self.held)))
        self.index.release([self.page[p] for p in prefixes])
        self._stamp(prefixes, -1)

    def _least_recently_used(self, prefixes: list[tuple[int, ...]]) -> tuple[int, ...]:
        return min(prefixes, key=lambda p: (self.tick[p], -len(p)))  # one tick = one path: deeper first

    @rule(pages_wanted=st.integers(0, 4), checkpoints_wanted=st.integers(0, 3))
    def evict(self, pages_wanted: int, checkpoints_wanted: int) -> None:
        idle = [p for p in self.page if self.users[p] == 0]
        assert self.index.evictable() == (len(idle), sum(p in self.checkpoint for p in idle))
        pages, checkpoints = [], []
        while len(pages) < pages_wanted:
            parents = {p[: -self.index.page_size] for p in self.page}
            leaves = [p for p in self.page if self.users[p] == 0 and p not in parents]
            if not leaves:
                break
            prefix = self._least_recently_used(leaves)
            pages.append(self.page.pop(prefix))
            checkpoints += [self.checkpoint.pop(prefix)] if prefix in self.checkpoint else []
        while len(checkpoints) < checkpoints_wanted:
            idle_checkpoints = [p for p in self.checkpoint if self.users[p] == 0]
            if not idle_checkpoints:
                break
            checkpoints.append(self.checkpoint.pop(self._least_recently_used(idle_checkpoints)))
        freed = self.index.evict(pages_wanted, checkpoints_wanted)
        assert freed == Handles(pages=tuple(pages), checkpoints=tuple(checkpoints))
        self._give_back(freed)

    @rule(roll=st.integers(0, 9))
    def drop_all(self, roll: int) -> None:
        if roll:  # one time in ten: dropping everything too often would keep the index small
            return
        if self.held:
            with pytest.raises(PagesStillHeld):
                self.index.drop_all()
            return
        dropped = self.index.drop_all()
        assert set(dropped.pages) == set(self.page.values())
        assert set(dropped.checkpoints) == set(self.checkpoint.values())
        self._give_back(dropped)
        self.page, self.checkpoint = {}, {}

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "index"):
            return
        self.index.check()
        assert (len(self.index), self.index.num_checkpoints) == (len(self.page), len(self.checkpoint))
        # Every handle ever adopted is still cached or was given back exactly once (checked above).
        assert {*self.page.values(), *self.checkpoint.values()} == self.adopted - self.returned


PrefixMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_prefix_index_against_a_model = PrefixMachine.TestCase
