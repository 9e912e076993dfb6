"""One key for a prefix (`block_keys.py`) and the driver's view of decode's cache (`cache_view.py`):
the prefix index files its pages under the keys the driver computes, its journal's news keeps a view
equal to its keys through inserts and evictions, and a view finds the longest kept state a prompt
extends as a scan of every state would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from distpool.memory.prefix import (
    CacheJournal,
    CacheNews,
    CacheView,
    StateKey,
    chained_block_keys,
    prefix_key,
)
from distpool.memory.prefix.block_keys import ROOT_KEY
from distpool.memory.prefix.prefix_index import PrefixIndex


def test_a_key_names_the_whole_prefix_and_a_partial_block_chains_on_its_full_ones():
    a, b = chained_block_keys([1, 2, 3, 4, 5, 6], 2), chained_block_keys([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and all(len(k) == 16 for k in a) and a[1] != b[1]  # same block, other prefix
    assert prefix_key([1, 2, 3, 4], 2) == a[1]  # whole blocks: the chain's key
    state = StateKey.of([1, 2, 3, 4, 5], 2)
    assert (state.num_tokens, state.blocks_key) == (5, a[1]) and state.key not in a
    assert StateKey.of([1], 2).blocks_key == ROOT_KEY
    assert prefix_key([1, 2, 3, 4, 5], 2) != prefix_key([1, 2, 3, 4, 6], 2)


def test_the_journal_reports_each_key_once_as_it_is_now():
    journal = CacheJournal()
    journal.page(b"a", cached=True)
    journal.page(b"b", cached=True)
    journal.page(b"a", cached=False)  # cached and evicted since the last report: evicted
    state = StateKey.of([1, 2, 3], 2)
    journal.state(state, kept=False)
    journal.state(state, kept=True)  # dropped, then kept again: kept
    news = CacheNews(cached_pages=(b"b",), evicted_pages=(b"a",), kept_states=(state,), report=1)
    assert journal.take() == news
    assert not journal and journal.take() == CacheNews()  # nothing new: no report


def test_a_dropped_state_is_known_stale_only_once_its_report_was_seen():
    journal = CacheJournal()
    a, b = StateKey.of([1, 2, 3], 2), StateKey.of([4, 5], 2)
    journal.state(a, kept=True)
    journal.state(b, kept=True)
    assert journal.take().report == 1
    journal.state(a, kept=False)
    assert not journal.drop_reported(a, seen=1)  # not sent yet: in flight
    assert journal.take() == CacheNews(dropped_states=(a,), report=2)
    assert not journal.drop_reported(a, seen=1) and journal.drop_reported(a, seen=2)
    assert journal.drop_reported(StateKey.of([7], 2), seen=0)  # never kept here: a stale view
    view = CacheView(2)
    view.apply(CacheNews(kept_states=(a, b), report=1))
    view.apply(CacheNews())
    assert view.report == 1


prompts = st.lists(st.integers(0, 3), min_size=1, max_size=14)


@settings(max_examples=100, deadline=None)
@given(
    block=st.integers(1, 4),
    steps=st.lists(st.tuples(st.booleans(), prompts, st.integers(0, 5)), max_size=12),
)
def test_news_keeps_the_view_equal_to_the_index_through_inserts_and_evictions(block, steps):
    index = PrefixIndex(block, needs_checkpoint=False)
    index.journal = CacheJournal()
    view = CacheView(block)
    handles = iter(range(10_000))
    for insert, tokens, evict in steps:
        if insert:
            index.insert(tokens, [next(handles) for _ in range(len(tokens) // block)])
            assert set(chained_block_keys(tokens, block)) <= index.keys()  # filed under the driver's keys
        else:
            index.evict(evict)
        view.apply(index.journal.take())
        assert view.keys().pages == index.keys()
    index.drop_all()
    view.apply(index.journal.take())
    assert view.keys().pages == frozenset()


@settings(max_examples=150, deadline=None)
@given(block=st.integers(1, 4), kept=st.lists(prompts, max_size=10), asked=st.lists(prompts, max_size=6))
def test_the_longest_kept_state_is_found_as_a_scan_finds_it(block, kept, asked):
    view = CacheView(block)
    view.apply(CacheNews(kept_states=tuple(StateKey.of(t, block) for t in kept)))
    for prompt in asked:
        proper = [len(t) for t in kept if len(t) < len(prompt) and prompt[: len(t)] == t]
        assert view.longest_state(prompt) == (max(proper) if proper else None)
    if kept:
        view.apply(CacheNews(dropped_states=(StateKey.of(kept[0], block),)))
        assert StateKey.of(kept[0], block) not in view.keys().states
