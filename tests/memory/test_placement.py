"""Where pages go: extents (best fit, ascending, growth in place) against the first-fit baseline.

Default pool (factories.py): slot positions 0..9 (768 bytes), page positions 0..14 (512 bytes, 4
tokens each). Every scenario asserts exact page ids and ends with `check_invariants()`.
"""

from __future__ import annotations

import pytest

from distpool.memory.errors import PlacementUnknown
from distpool.memory.pool import NeedsCompaction
from tests.memory.placed_pool import make_placed_pool


def _holes(placement: str):
    """a..d packed from the top, then a and c released: page holes [9, 12) and [13, 15)."""
    pool = make_placed_pool(placement=placement)
    pool.reserve_batch([("a", 8), ("b", 4), ("c", 12), ("d", 8)])
    assert [pool.page_ids(r).tolist() for r in "abcd"] == [[13, 14], [12], [9, 10, 11], [7, 8]]
    pool.release_batch(["a", "c"])  # slots 0, 2 free; d's slot 3 keeps pages at 6 and up
    return pool


def test_extents_take_the_best_fitting_hole_and_grow_right_after_their_last_page():
    pool = _holes("extent")
    pool.reserve("e", 8)  # two pages: the hole of exactly two
    assert pool.page_ids("e").tolist() == [13, 14] and pool.slot_id("e") == 0
    pool.reserve("f", 8)  # two pages in the hole of three, at its low end
    assert pool.page_ids("f").tolist() == [9, 10]
    pool.extend("f", 4)  # its third page is the one right after its second
    assert pool.page_ids("f").tolist() == [9, 10, 11]
    pool.check_invariants()


def test_first_fit_takes_the_highest_free_pages_and_scatters_growth():
    pool = _holes("first_fit")
    pool.reserve("e", 8)
    assert pool.page_ids("e").tolist() == [13, 14]
    pool.reserve("f", 8)
    assert pool.page_ids("f").tolist() == [10, 11]
    pool.extend("f", 4)
    assert pool.page_ids("f").tolist() == [10, 11, 9]  # two runs where an extent has one
    pool.check_invariants()


def test_an_extent_too_large_for_any_hole_spans_the_largest_holes_in_ascending_order():
    pool = _holes("extent")
    pool.reserve("g", 20)  # five pages: holes of 3 and 2 (and one gap page at 6 left over)
    assert pool.page_ids("g").tolist() == [9, 10, 11, 13, 14]
    pool.check_invariants()


def test_blocked_growth_shares_one_extent_and_the_first_request_gets_its_top():
    pool = make_placed_pool()
    pool.reserve_batch([("a", 4), ("b", 4)])  # a: 14, b: 13, packed: neither can grow in place
    pool.extend_batch([("a", 8), ("b", 4)])  # a needs 2 pages, b 1: one extent of 3 at the gap top
    assert pool.page_ids("a").tolist() == [14, 11, 12] and pool.page_ids("b").tolist() == [13, 10]
    pool.check_invariants()


def test_a_decode_step_of_one_page_each_grows_in_place_where_it_can_and_shares_one_extent():
    pool = make_placed_pool()
    pool.reserve_batch([("a", 4), ("b", 4), ("c", 4), ("d", 4)])  # a 14, b 13, c 12, d 11
    pool.release("b")  # 13 is free: a cannot grow in place (15 is past the band), c can
    pool.extend_batch([(r, 1) for r in "acd"])  # one page each
    # c takes 13 in place; a and d share one extent at the gap's top (9, 10), a its top.
    assert [pool.page_ids(r).tolist() for r in "acd"] == [[14, 10], [12, 13], [11, 9]]
    pool.check_invariants()


def test_a_decode_step_without_a_page_boundary_touches_no_band(monkeypatch):
    pool = make_placed_pool()
    pool.reserve_batch([(f"r{i}", 4 * i + 1) for i in range(3)])

    def no_growth(*args):
        raise AssertionError("a step inside every request's last page placed a page")

    monkeypatch.setattr(pool.allocator.placement, "growth_positions", no_growth)
    pool.extend_batch([(f"r{i}", 3) for i in range(3)])  # 4i + 4 tokens: still i + 1 pages
    assert [pool.num_tokens(f"r{i}") for i in range(3)] == [4, 8, 12]
    pool.check_invariants()


def test_compaction_keeps_each_extent_one_run_and_a_fragmented_reserve_asks_for_it():
    pool = make_placed_pool()
    pool.reserve_batch([(f"s{i}", 0) for i in range(6)])  # slots 0..5
    pool.release_batch([f"s{i}" for i in range(5)])  # s5 alone at slot 5: pages only from 9 up
    pool.reserve("x", 16)  # slot 0, four pages at the top
    with pytest.raises(NeedsCompaction):
        pool.reserve("long", 24)  # a slot and six pages: room once s5 moves down
    pool.reserve("long", 24, compact=True)
    assert pool.slot_id("s5") == 1 and pool.page_ids("x").tolist() == [11, 12, 13, 14]
    assert pool.page_ids("long").tolist() == [5, 6, 7, 8, 9, 10]
    pool.check_invariants()


def test_an_unknown_placement_is_refused():
    with pytest.raises(PlacementUnknown) as refused:
        make_placed_pool(placement="best")
    assert (refused.value.mode, refused.value.known) == ("best", ("extent", "first_fit"))
