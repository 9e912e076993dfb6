"""The decode step's fast paths: a repeated batch reuses its checked ids and rows (`checked_rows`),
and one page per growing request is placed without per-request work. Each scenario checks that
what a reused check would get wrong (a released id, a new pin, a changed count) is still seen.

Default pool (factories.py): slot positions 0..9, page positions 0..14 (4 tokens each).
"""

from __future__ import annotations

import numpy as np
import pytest

from distpool.memory.pool import DuplicateRequest, RequestPinned, TokenCountInvalid, UnknownRequest
from tests.factories import accounting
from tests.memory.placed_pool import make_placed_pool


def _step(pool, ids: str) -> None:
    """One decode step over `ids`, built afresh as a decode loop does."""
    pool.extend_batch([(rid, 1) for rid in ids])


def test_a_released_id_reserved_again_gets_its_new_row():
    pool = make_placed_pool()
    pool.reserve_batch([("a", 1), ("b", 1)])
    _step(pool, "ab")
    _step(pool, "ab")  # the ids repeat: the batch is kept
    pool.release("a")
    pool.reserve("c", 9)  # takes the row "a" left
    pool.reserve("a", 5)  # the same id, another row
    _step(pool, "ab")
    assert [pool.num_tokens(r) for r in "abc"] == [6, 4, 9]
    assert len(pool.page_ids("a")) == 2 and len(pool.page_ids("c")) == 3
    pool.check_invariants()


def test_a_released_id_in_a_repeated_batch_is_unknown():
    pool = make_placed_pool()
    pool.reserve_batch([("a", 1), ("b", 1)])
    _step(pool, "ab")
    _step(pool, "ab")
    pool.release("b")
    before = accounting(pool)
    with pytest.raises(UnknownRequest):
        _step(pool, "ab")
    assert accounting(pool) == before and pool.num_tokens("a") == 3
    pool.check_invariants()


def test_a_pin_between_two_repeated_batches_refuses_the_step_and_changes_nothing():
    pool = make_placed_pool()
    pool.reserve_batch([("a", 1), ("b", 4)])
    _step(pool, "ab")
    _step(pool, "ab")
    pool.pin("b")
    before = accounting(pool)
    with pytest.raises(RequestPinned) as info:
        _step(pool, "ab")
    assert (info.value.call, info.value.request_id) == ("extend", "b")
    assert accounting(pool) == before and [pool.num_tokens(r) for r in "ab"] == [3, 6]
    pool.unpin("b")
    _step(pool, "ab")
    assert [pool.num_tokens(r) for r in "ab"] == [4, 7]
    pool.check_invariants()


def test_counts_equal_to_a_kept_batch_but_not_plain_ints_are_checked():
    pool = make_placed_pool()
    pool.reserve_batch([("a", 1), ("b", 1)])
    _step(pool, "ab")
    _step(pool, "ab")
    for bad in (True, 1.0, -1):
        with pytest.raises(TokenCountInvalid) as info:
            pool.extend_batch([("a", 1), ("b", bad)])
        assert (info.value.request_id, info.value.value) == ("b", bad)
    pool.extend_batch([("a", np.int64(1)), ("b", 1)])  # an integer, though not a plain int
    pool.extend_batch([("a", 3), ("b", 1)])  # the same ids, other counts
    assert [pool.num_tokens(r) for r in "ab"] == [7, 5]
    pool.check_invariants()


def test_a_batch_list_changed_in_place_is_checked_again():
    pool = make_placed_pool()
    pool.reserve_batch([("a", 1), ("b", 1), ("c", 1)])
    step = [("a", 1), ("b", 1)]
    pool.extend_batch(step)
    pool.extend_batch(step)
    step[1] = ("c", 1)  # the caller reuses its list
    pool.extend_batch(step)
    assert [pool.num_tokens(r) for r in "abc"] == [4, 3, 2]
    step[1] = ("a", 1)
    with pytest.raises(DuplicateRequest) as info:
        pool.extend_batch(step)
    assert (info.value.request_id, info.value.in_batch) == ("a", True)
    entries = [["a", 1], ["b", 1]]  # mutable entries are snapshotted, never trusted
    pool.extend_batch(entries)
    pool.extend_batch(entries)
    entries[1][0] = "c"
    pool.extend_batch(entries)
    assert [pool.num_tokens(r) for r in "abc"] == [7, 5, 3]
    pool.check_invariants()


@pytest.mark.parametrize("placement", ["extent", "first_fit"])
def test_a_decode_step_where_nothing_grows_in_place_takes_one_extent_first_request_on_top(placement):
    pool = make_placed_pool(placement=placement)
    pool.reserve_batch([("a", 4), ("b", 4), ("c", 4), ("z", 0)])  # a 14, b 13, c 12, z none: packed
    _step(pool, "abcz")
    assert [pool.page_ids(r).tolist() for r in "abcz"] == [[14, 11], [13, 10], [12, 9], [8]]
    pool.check_invariants()


@pytest.mark.parametrize("placement", ["extent", "first_fit"])
def test_growth_by_several_pages_keeps_each_request_ascending(placement):
    pool = make_placed_pool(placement=placement)
    pool.reserve_batch([("a", 4), ("b", 4)])  # a 14, b 13
    pool.extend_batch([("a", 8), ("b", 4)])  # three pages, the highest free ones: a takes two
    assert [pool.page_ids(r).tolist() for r in "ab"] == [[14, 11, 12], [13, 10]]
    pool.check_invariants()
