"""Pool scenarios: exact ids, all-or-nothing reserves, compaction, pins, sliding windows, static limits.

Default pool (factories.py): unified hybrid Mamba, a 7680-byte arena: slot positions 0..9 (768 bytes
each, from offset 0) and page positions 0..14 (512 bytes each, page 14 ends at 7680). Every scenario
ends with `check_invariants()`.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from distpool.memory.arena.runs import merge_runs
from distpool.memory.arena_pool import build_pool
from distpool.memory.pool import (
    BandUsage,
    DoesNotFit,
    DuplicateRequest,
    InvariantBroken,
    NeedsCompaction,
    NotPinned,
    RequestPinned,
    TokenCountInvalid,
    UnknownRequest,
)
from distpool.model.spec import DENSE, HYBRID_SWA
from tests.factories import accounting, free_units, make_pool, make_sizes, make_spec


def _fill(pool, request_id: str, seed: int) -> torch.Tensor:
    """Write random bytes over the request's whole envelope; return them in envelope order."""
    gen = torch.Generator().manual_seed(seed)
    chunks = []
    for offset, nbytes in pool.envelope_ranges(request_id).tolist():
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        pool.buffer[offset : offset + nbytes] = data
        chunks.append(data)
    return torch.cat(chunks)


def _read(pool, request_id: str) -> torch.Tensor:
    return torch.cat([pool.buffer[o : o + n] for o, n in pool.envelope_ranges(request_id).tolist()])


def test_first_reserve_gets_the_top_pages_and_the_bottom_slot():
    pool = make_pool()
    pool.reserve("a", 5)  # 5 tokens: 2 pages of 4
    assert pool.page_ids("a").tolist() == [13, 14]  # token order runs up through the top two pages
    assert pool.slot_id("a") == 0 and pool.num_tokens("a") == 5
    assert pool.envelope_ranges("a").tolist() == [[0, 768], [13 * 512, 512], [14 * 512, 512]]
    env = pool.envelope("a")
    assert (env.request_id, env.num_tokens, env.has_slot) == ("a", 5, True)
    assert env.ranges.tolist() == env.moving.tolist() == pool.envelope_ranges("a").tolist()
    assert env.num_bytes == 768 + 2 * 512
    held = pool.envelope("a", held_pages=1)  # the first page is held at this end: it does not move
    assert held.moving.tolist() == [[0, 768], [14 * 512, 512]] and held.num_bytes == 768 + 512
    pool.check_invariants()


def test_a_batch_hands_out_in_request_order_and_extend_continues_downward():
    pool = make_pool()
    pool.reserve_batch([("a", 8), ("b", 1), ("c", 0)])
    assert [pool.page_ids(r).tolist() for r in "abc"] == [[13, 14], [12], []]
    assert [pool.slot_id(r) for r in "abc"] == [0, 1, 2]
    pool.extend("b", 3)  # 4 tokens: still one page
    assert pool.page_ids("b").tolist() == [12]
    pool.extend_batch([("b", 1), ("c", 2)])
    assert pool.page_ids("b").tolist() == [12, 11] and pool.page_ids("c").tolist() == [10]
    assert pool.num_tokens("b") == 5
    pool.check_invariants()


def test_release_returns_everything():
    pool = make_pool()
    fresh = free_units(pool)
    assert fresh == {"pages": 15, "slots": 10}
    pool.reserve_batch([("a", 9), ("b", 3)])
    pool.release("a")
    pool.release_batch(["b"])
    assert free_units(pool) == fresh and pool.request_ids == []
    pool.check_invariants()


def test_a_batch_that_does_not_fit_takes_nothing():
    pool = make_pool()
    pool.reserve("a", 4)
    before = accounting(pool)
    # Three 16-token requests need 3 slots (2304 bytes) + 12 pages (6144 bytes) > 7680 - a's 1280.
    with pytest.raises(DoesNotFit) as info:
        pool.reserve_batch([("x", 16), ("y", 16), ("z", 16)])
    assert (info.value.request_id, info.value.low, info.value.pages) == ("x", 3, 12)
    assert not isinstance(info.value, NeedsCompaction)
    assert accounting(pool) == before and "x" not in pool
    with pytest.raises(DoesNotFit):
        pool.extend("a", 56)  # 60 tokens: 14 more pages; 12 are free above slot 0
    assert accounting(pool) == before and pool.num_tokens("a") == 4
    pool.check_invariants()


def test_bad_calls_raise_typed_errors_and_leave_accounting_intact():
    pool = make_pool()
    pool.reserve("a", 4)
    before = accounting(pool)
    refusals = [
        (lambda: pool.release("nope"), UnknownRequest, {"request_id": "nope"}),
        (lambda: pool.page_ids("nope"), KeyError, {"request_id": "nope"}),  # UnknownRequest is a KeyError
        (
            lambda: pool.reserve("a", 1),
            DuplicateRequest,
            {"call": "reserve", "request_id": "a", "in_batch": False},
        ),
        (
            lambda: pool.reserve_batch([("c", 1), ("b", 1), ("c", 1)]),
            DuplicateRequest,
            {"call": "reserve", "request_id": "c", "in_batch": True},
        ),
        (lambda: pool.release_batch(["a", "a"]), DuplicateRequest, {"call": "release", "in_batch": True}),
        (lambda: pool.extend("a", -1), TokenCountInvalid, {"call": "extend", "request_id": "a", "value": -1}),
        (
            lambda: pool.reserve("b", -4),
            TokenCountInvalid,
            {"call": "reserve", "request_id": "b", "value": -4},
        ),
        (lambda: pool.reserve("b", 2.5), TokenCountInvalid, {"value": 2.5}),
        (lambda: pool.reserve("b", True), TokenCountInvalid, {"value": True}),  # a bool is no count
        (lambda: pool.unpin("a"), NotPinned, {"request_id": "a"}),
        (lambda: pool.release_batch(["a", "nope"]), UnknownRequest, {"request_id": "nope"}),  # frees nothing
    ]
    for call, error, facts in refusals:
        with pytest.raises(error) as info:
            call()
        assert {name: getattr(info.value, name) for name in facts} == facts
        assert accounting(pool) == before
    pool.pin("a")
    for call, name in ((lambda: pool.release("a"), "release"), (lambda: pool.extend("a", 1), "extend")):
        with pytest.raises(RequestPinned) as info:
            call()
        assert (info.value.call, info.value.request_id) == (name, "a")
    pool.unpin("a")
    assert accounting(pool) == before
    pool.check_invariants()


@pytest.mark.parametrize(
    "error",
    [
        UnknownRequest("r1"),
        DuplicateRequest("release", "r1", in_batch=True),
        RequestPinned("extend", "r1"),
        NotPinned("r1"),
        TokenCountInvalid("reserve", "r1", -2),
        DoesNotFit("r1", "no room", low=1, pages=3, low_free=0, pages_free=2, pinned=1),
        NeedsCompaction("r1", "scattered", low=1, pages=3, window=3, window_at=5, pages_free=4),
    ],
)
def test_memory_errors_cross_a_process_boundary_with_their_facts(error):
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), vars(copy), str(copy)) == (type(error), vars(error), str(error))


def test_fragmented_slots_need_compaction_and_compaction_moves_the_frontier():
    pool = make_pool()
    pool.reserve_batch([(f"s{i}", 0) for i in range(6)])  # slots 0..5, no pages
    pool.release_batch([f"s{i}" for i in range(5)])  # s5 alone at slot 5 pins the frontier at 4608
    content = _fill(pool, "s5", seed=1)
    assert pool.available()["pages"] == 6  # positions 9..14
    assert pool.available(after_compaction=True)["pages"] == 13  # s5 moved to slot 0 (ends at 768): 2..14
    assert not pool.can_reserve(28) and pool.can_reserve(28, compact=True)
    with pytest.raises(NeedsCompaction) as info:
        pool.reserve("long", 28)  # a slot and 7 pages
    assert (info.value.low, info.value.pages, info.value.pages_free) == (1, 7, 6)
    assert pool.compact() == 768
    assert pool.slot_id("s5") == 0 and torch.equal(_read(pool, "s5"), content)
    pool.reserve("long", 28)
    assert pool.slot_id("long") == 1 and pool.page_ids("long").tolist() == list(range(8, 15))
    pool.check_invariants()


def test_pins_keep_an_envelope_in_place():
    pool = make_pool()
    pool.reserve_batch([(f"s{i}", 0) for i in range(6)])
    pool.release_batch([f"s{i}" for i in range(5)])
    pool.pin("s5")
    assert pool.usage()["slots"].pinned == 1 and pool.usage()["slots"].used == 0
    with pytest.raises(DoesNotFit) as info:
        pool.reserve("long", 28)
    assert not isinstance(info.value, NeedsCompaction) and info.value.pinned == 1
    assert pool.compact() == 0 and pool.slot_id("s5") == 5
    pool.check_invariants()
    pool.unpin("s5")
    assert pool.compact() == 768 and pool.slot_id("s5") == 0
    pool.check_invariants()


def test_compaction_slides_pages_up_in_order_and_preserves_every_envelope():
    pool = make_pool()
    pool.reserve_batch([("a", 8), ("b", 8), ("c", 8)])  # pages a:13,14 b:11,12 c:9,10; slots 0,1,2
    contents = {r: _fill(pool, r, seed=i) for i, r in enumerate("bc")}
    pool.release("a")
    moves = pool.allocator.compaction_moves()
    # c's slot 2 -> 0 (one run); pages 9..12 slide up by two into 11..14: one run of four pages
    # whose destination overlaps its source (copied through the staging buffer).
    assert moves.runs_bytes.tolist() == [[2 * 768, 0, 768], [9 * 512, 11 * 512, 2048]]
    assert pool.compact() == 768 + 2048
    assert pool.page_ids("c").tolist() == [11, 12] and pool.slot_id("c") == 0
    assert pool.page_ids("b").tolist() == [13, 14] and pool.slot_id("b") == 1
    for r, content in contents.items():
        assert torch.equal(_read(pool, r), content)
    assert pool.compact() == 0  # already packed
    pool.check_invariants()


def test_first_fit_compaction_fills_holes_unit_by_unit():
    pool = build_pool(make_sizes(), "cpu", placement="first_fit")
    pool.reserve_batch([("a", 8), ("b", 8), ("c", 8)])  # pages a:13,14 b:11,12 c:9,10; slots 0,1,2
    contents = {r: _fill(pool, r, seed=i) for i, r in enumerate("bc")}
    pool.release("a")
    moves = pool.allocator.compaction_moves()
    # c's slot 2 -> 0 (one run), c's pages 9,10 -> 13,14 (one run of two pages); b stays.
    assert moves.runs_bytes.tolist() == [[2 * 768, 0, 768], [9 * 512, 13 * 512, 1024]]
    assert pool.compact() == 768 + 1024
    assert pool.page_ids("c").tolist() == [13, 14] and pool.page_ids("b").tolist() == [11, 12]
    for r, content in contents.items():
        assert torch.equal(_read(pool, r), content)
    pool.check_invariants()


def test_moves_merge_into_runs_contiguous_on_both_sides():
    src, dst = [5, 6, 7, 9], [0, 1, 3, 4]
    # (5,0) (6,1) contiguous; (7,3) breaks on dst; (9,4) breaks on src.
    assert merge_runs(src, dst, [1, 1, 1, 1]).tolist() == [[5, 0, 2], [7, 3, 1], [9, 4, 1]]


def test_sliding_window_pages_leave_as_the_request_grows():
    pool = make_pool(make_spec(HYBRID_SWA, sliding_window=8), budget_bytes=16384)
    assert (pool.arena.low.name, pool.arena.low.stride_bytes, pool.arena.high.stride_bytes) == (
        "swa_pages",
        512,
        512,
    )
    pool.reserve("r", 8)  # the window holds all 8 tokens: SWA pages 0, 1
    assert pool.swa_page_ids("r").tolist() == [0, 1] and pool.page_ids("r").numel() == 2
    pool.extend("r", 1)  # 9 tokens: window [1, 9) touches token pages 0..2
    assert pool.swa_page_ids("r").tolist() == [0, 1, 2] and pool.swa_first_page("r") == 0
    pool.extend("r", 4)  # 13 tokens: window [5, 13) is token pages 1..3; page 0 leaves and is reused
    assert pool.swa_page_ids("r").tolist() == [1, 2, 0] and pool.swa_first_page("r") == 1
    assert pool.page_ids("r").numel() == 4  # full attention keeps every page
    pool.reserve("s", 4)
    assert pool.swa_page_ids("s").tolist() == [3]
    # Ranges: full pages in token order, then the window's pages in token order.
    ranges = pool.envelope_ranges("r")
    assert ranges[:4, 1].tolist() == [512] * 4 and ranges[4:, 0].tolist() == [512, 1024, 0]
    pool.extend("r", 40)  # 53 tokens, a jump past the whole window: [45, 53) is token pages 11..13
    assert pool.swa_first_page("r") == 11 and pool.swa_page_ids("r").numel() == 3
    pool.check_invariants()


def test_a_full_static_swa_pool_still_slides_the_window():
    spec = make_spec(HYBRID_SWA, sliding_window=4)
    pool = make_pool(spec, unified=False, budget_bytes=16384, context_len=8)
    n = pool.arena.low.num_positions  # 14 SWA pages, 17 full pages
    pool.reserve_batch([(f"r{i}", 4) for i in range(n)])  # one SWA page and one full page each
    assert pool.available() == {"swa_pages": 0, "pages": 17 - n}
    pool.extend("r0", 4)  # 8 tokens: window [4, 8) is page 1 alone; page 0 makes room for it
    assert pool.swa_page_ids("r0").numel() == 1 and pool.swa_first_page("r0") == 1
    pool.check_invariants()


def test_static_state_pool_full_while_kv_has_room_but_unified_takes_it():
    static = make_pool(unified=False, budget_bytes=7680)  # 5 slots, 7 pages
    static.reserve_batch([(f"r{i}", 1) for i in range(5)])
    assert static.available()["pages"] == 2
    with pytest.raises(DoesNotFit) as info:
        static.reserve("r5", 1)
    assert (info.value.low, info.value.low_free) == (1, 0)
    assert not isinstance(info.value, NeedsCompaction)
    assert static.compact() == 0  # a fixed frontier: nothing to gain
    static.check_invariants()

    unified = make_pool(unified=True, budget_bytes=7680)
    unified.reserve_batch([(f"r{i}", 1) for i in range(6)])  # slots 0..5 end at 4608; pages 9..14
    assert unified.page_ids("r5").tolist() == [9] and unified.available()["pages"] == 0
    unified.check_invariants()


def test_dense_pool_has_pages_only():
    pool = make_pool(make_spec(DENSE), unified=False, budget_bytes=7168)  # 7 pages of 1024
    pool.reserve("a", 6)
    assert pool.slot_id("a") is None and pool.page_ids("a").tolist() == [5, 6]
    assert pool.envelope_ranges("a").tolist() == [[5 * 1024, 1024], [6 * 1024, 1024]]
    assert not pool.envelope("a").has_slot
    pool.check_invariants()


def test_usage_splits_free_held_pinned():
    pool = make_pool()
    pool.reserve_batch([("a", 8), ("b", 4)])
    pool.pin("b")
    usage = pool.usage()
    assert usage["pages"] == BandUsage(capacity=15, free=12, held=3, pinned=1) and usage["pages"].used == 2
    assert usage["slots"] == BandUsage(capacity=10, free=8, held=2, pinned=1) and usage["slots"].used == 1
    # Pages may use every position above slot 1 (ends at 1536): 3..14 less the 3 held; slots every
    # position below page 12 (starts at 6144): 0..7 less the 2 held.
    assert pool.available() == {"pages": 9, "slots": 6}
    pool.check_invariants()


def test_check_invariants_names_what_broke():
    pool = make_pool()
    pool.reserve("a", 8)
    pool.allocator.high_band.owned[0] = True  # a position owned by nobody's map
    with pytest.raises(InvariantBroken) as err:
        pool.check_invariants()
    assert (err.value.code, err.value.subject) == ("owned-count", "high band")
    pool.allocator.high_band.owned[0] = False
    table = pool.allocator.holdings
    table.num_tokens[table.rows["a"]] = 9  # the request claims more than it holds
    with pytest.raises(InvariantBroken) as err:
        pool.check_invariants()
    assert (err.value.code, err.value.subject) == ("pages-cover-tokens", "a")
    assert isinstance(err.value, AssertionError)  # what a check has always raised
    assert vars(pickle.loads(pickle.dumps(err.value))) == vars(err.value)


def test_a_targeted_plans_copies_keep_its_order_and_a_slides_run_highest_first():
    frontier = make_pool().allocator.frontier
    none = np.zeros(frontier.high_band.num_positions, dtype=bool)
    low_none = np.zeros(frontier.low_band.num_positions, dtype=bool)
    plan = (np.array([5, 6, 3]), np.array([9, 10, 5]))  # 3 -> 5 only after 5 has left
    given = frontier.compaction_moves(low_none, none, plan, high_slide=False).runs_bytes.tolist()
    assert given == [[5 * 512, 9 * 512, 1024], [3 * 512, 5 * 512, 512]]
    slide = frontier.compaction_moves(low_none, none, plan, high_slide=True).runs_bytes.tolist()
    assert slide == given[::-1]


def test_after_needs_compaction_compact_makes_room_even_when_requests_keep_growth_room():
    # Requests that announce their growth keep room after their pages; a refusal that says
    # "compaction would make room" is about the full compaction, which `compact()` must be (the
    # one that keeps growth room can leave a slot short: seed 1 of this mix did).
    import random

    from tests.memory.placed_pool import make_placed_pool

    for seed in range(4):
        rng = random.Random(seed)
        pool = make_placed_pool(unified=True, budget_bytes=12288)
        live: list[str] = []
        for step in range(30):
            rid, op = f"r{step}", rng.random()
            if op < 0.5:
                tokens = rng.randint(0, 40)
                try:
                    pool.reserve(rid, tokens, compact=True, final_tokens=tokens + rng.randint(0, 24))
                    live.append(rid)
                except DoesNotFit:
                    pass
            elif op < 0.7 and live:
                pool.release(live.pop(rng.randrange(len(live))))
            else:
                try:
                    pool.reserve(rid, 0)
                except NeedsCompaction:
                    pool.compact()
                    pool.reserve(rid, 0)  # promised
                except DoesNotFit:
                    continue
                live.append(rid)
            pool.check_invariants()
