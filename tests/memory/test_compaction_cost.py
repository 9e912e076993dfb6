"""When the allocator moves pages and when it scatters: the cost model (move_cost.py) at work.

Pool: the default spec on 16 KiB (page positions 0..31 of 512 bytes, slot positions 0..20 of 768
bytes). `_comb()` leaves six one-page holes at 31, 29, ..., 21 between single-page requests, and
two free pages at the top of the gap (18, 19), above twelve slots' worth of the low band.
"""

from __future__ import annotations

from distpool.memory.alloc.move_cost import MoveCost
from distpool.memory.arena.runs import num_runs
from distpool.memory.pool import NeedsCompaction
from tests.memory.placed_pool import make_placed_pool

PAGE_BYTES = 512


def _comb():
    pool = make_placed_pool(budget_bytes=16384, context_len=64)
    ids = [f"r{i}" for i in range(12)]
    pool.reserve_batch([(rid, 4) for rid in ids])  # one page each, r0 at 31 down to r11 at 20
    pool.release_batch(ids[::2])  # r0, r2, ..., r10 leave: holes at 31, 29, ..., 21
    return pool


def _layout(pool) -> dict[str, tuple[list[int], int | None]]:
    return {rid: (pool.page_ids(rid).tolist(), pool.slot_id(rid)) for rid in pool.request_ids}


def test_the_cost_of_a_plan_is_the_bytes_it_copies_and_the_runs_it_adds_or_joins():
    cost = MoveCost(page_bytes=PAGE_BYTES, run_bytes=10, max_runs=4, over_run_bytes=10_000)
    assert cost.of(3, 1, 1) == 3 * PAGE_BYTES
    assert cost.of(0, 1, 3) == 2 * 10  # two runs added, within the bound
    assert cost.of(0, 4, 6) == 2 * 10 + 2 * 10_000  # two runs past the bound
    assert cost.of(5, 6, 1) == 5 * PAGE_BYTES - 5 * 10 - 2 * 10_000  # joining them pays
    assert cost.of(0, [1, 2], [2, 2]) == 10  # envelopes summed


def test_a_reserve_that_would_scatter_past_the_run_bound_moves_only_the_pages_in_the_way():
    pool = _comb()
    before = _layout(pool)
    # Five pages: no hole holds them and the gap has two, so they would take five one-page holes:
    # past the bound of four runs. Clearing 27..31 moves r1 and r3 (one page each) instead.
    pool.reserve("big", 20, compact=True)
    assert pool.page_ids("big").tolist() == [27, 28, 29, 30, 31]
    assert pool.compactions()[:2] == (1, 2 * PAGE_BYTES)
    after = _layout(pool)
    assert after["r1"] == ([25], 1) and after["r3"] == ([23], 3)  # into the holes below
    # Nobody else moved, and no slot did (the low band stays where it is).
    assert {rid: after[rid] for rid in before if rid not in ("r1", "r3")} == {
        rid: layout for rid, layout in before.items() if rid not in ("r1", "r3")
    }
    pool.check_invariants()


def test_a_reserve_scatters_within_the_bound_when_a_run_costs_less_than_moving_a_page():
    pool = _comb()
    pool.allocator.planner.cost = MoveCost(page_bytes=PAGE_BYTES, run_bytes=100)
    pool.reserve("mid", 12, compact=True)  # three pages: three one-page holes, the largest
    assert pool.page_ids("mid").tolist() == [21, 23, 25]
    assert pool.compactions()[0] == 0
    pool.check_invariants()


def test_a_run_dearer_than_a_page_clears_a_run_even_within_the_bound():
    pool = _comb()
    pool.allocator.planner.cost = MoveCost(page_bytes=PAGE_BYTES, run_bytes=4 * PAGE_BYTES)
    pool.reserve("mid", 12, compact=True)
    assert num_runs(pool.page_ids("mid").numpy()) == 1
    assert pool.compactions()[:2] == (1, PAGE_BYTES)
    pool.check_invariants()


def test_growth_that_would_scatter_past_the_bound_clears_one_run_for_it():
    pool = _comb()
    pool.reserve("g", 4)  # one page, in the best-fitting hole at 31
    assert pool.page_ids("g").tolist() == [31]
    # Four more pages: nothing free after 31, and no free run holds four, so they would scatter
    # over four holes (five runs). The allocator refuses, taking nothing...
    try:
        pool.allocator.extend_batch([("g", 16)], prefer_compaction=True)
        raise AssertionError("scattered growth past the bound must ask for a compaction")
    except NeedsCompaction as needs:
        assert (needs.low, needs.pages, needs.window) == (0, 4, 4)
    assert pool.page_ids("g").tolist() == [31] and pool.num_tokens("g") == 4
    # ...and the pool moves one page (r11's, at 20) so that 18..21 hold them in one run.
    pool.extend("g", 16, compact=True)
    assert pool.page_ids("g").tolist() == [31, 18, 19, 20, 21]
    assert pool.compactions()[:2] == (1, PAGE_BYTES)
    pool.check_invariants()


def test_without_compaction_growth_scatters_as_before():
    pool = _comb()
    pool.reserve("g", 4)
    pool.extend("g", 16)
    assert pool.page_ids("g").tolist() == [31, 21, 23, 25, 27]
    assert pool.compactions()[0] == 0
    pool.check_invariants()


def test_growth_past_the_bound_clears_the_pages_right_after_the_request_when_that_is_cheapest():
    pool = _comb()
    pool.allocator.planner.cost = MoveCost(page_bytes=PAGE_BYTES, max_runs=1)  # one run at most
    pool.reserve_batch([("g", 4), ("h", 4)])  # the best-fitting holes: 31, then 29
    assert pool.page_ids("h").tolist() == [29]
    # h's next page would go elsewhere (30 is r1's): a second run, past the bound. Moving r1 (one
    # page, to the highest free hole) lets h grow in place instead.
    pool.extend("h", 4, compact=True)
    assert pool.page_ids("h").tolist() == [29, 30]
    assert pool.page_ids("r1").tolist() == [27]
    assert pool.compactions()[:2] == (1, PAGE_BYTES)
    pool.check_invariants()
