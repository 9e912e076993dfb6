"""Decode's final states: a finished request's state and partial page, kept in its pool's prefix cache
as cache (not a leak), restored byte for byte into a next turn, superseded by that turn's own, and
given up, least recently used first, when a request needs the room."""

from __future__ import annotations

import torch

from distpool.memory.arena_pool import ArenaPool, build_pool
from tests.factories import make_sizes

PAGE = 4


def decode_pool(budget_bytes: int = 24576) -> ArenaPool:
    sizes = make_sizes(budget_bytes=budget_bytes, prefix_cache=True, disaggregation_mode="decode")
    pool = build_pool(sizes, "cpu", checkpoints=False, final_states=True)
    assert pool.prefix_cache is not None and pool.prefix_cache.final_states is not None
    return pool


def slot_bytes(pool: ArenaPool, slot: int) -> torch.Tensor:
    low = pool.arena.low
    return pool.buffer[low.base_bytes + slot * low.stride_bytes :][: low.stride_bytes]


def page_bytes(pool: ArenaPool, page: int) -> torch.Tensor:
    high = pool.arena.high
    return pool.buffer[high.base_bytes + page * high.stride_bytes :][: high.stride_bytes]


def finish(pool: ArenaPool, rid: str, tokens: list[int], fill: int) -> bool:
    """A request that held `tokens`, its slot and pages filled with `fill`: cache it, keep its state."""
    pool.reserve(rid, len(tokens))
    slot_bytes(pool, pool.slot_id(rid)).fill_(fill)
    for page in pool.page_ids(rid).tolist():
        page_bytes(pool, page).fill_(fill + 1)
    pool.prefix_cache.cache_request(rid, tokens)
    kept = pool.prefix_cache.final_states.keep(rid, tokens)
    pool.release(rid)
    pool.check_invariants()
    return kept


def balanced(pool: ArenaPool) -> None:
    for usage in pool.usage().values():
        assert usage.free + usage.held == usage.capacity


def test_a_kept_state_is_cache_and_restores_into_the_next_turn():
    pool = decode_pool()
    tokens = list(range(1, 11))  # 10 tokens: 2 full pages and a partial one of 2 tokens
    assert finish(pool, "t0", tokens, fill=7)
    usage = pool.usage()
    assert (usage["slots"].held, usage["slots"].cached) == (1, 1)  # the state: cache, not a request's
    assert usage["pages"].cached == 3  # 2 full pages in the index, and the partial page
    states = pool.prefix_cache.final_states
    entry = states.find(tokens + [11, 12, 13])
    assert entry is not None and entry.num_tokens == 10 and len(entry.pages) == 2
    assert states.find(tokens) is None  # a prompt must extend it: the last token has to be computed
    nxt = tokens + [11, 12, 13]
    pool.reserve("t1", len(nxt), prefix=entry.prefix_match(PAGE))
    states.restore(entry, "t1")
    assert bool((slot_bytes(pool, pool.slot_id("t1")) == 7).all())
    assert bool((page_bytes(pool, int(pool.page_ids("t1")[2])) == 8).all())  # its own copy of the page
    assert pool.page_ids("t1")[:2].tolist() == [
        int(pool.allocator.high_band.physical(torch.tensor(entry.pages).numpy())[i]) for i in range(2)
    ]
    pool.check_invariants()
    pool.release("t1")
    pool.prefix_cache.drop_all()
    balanced(pool)
    assert all(u.held == 0 for u in pool.usage().values())  # dropped: nothing leaks


def test_a_later_turn_supersedes_the_state_of_the_one_before():
    pool = decode_pool()
    first = list(range(1, 11))
    assert finish(pool, "t0", first, fill=3)
    second = first + [11, 12, 13, 14, 15]
    assert finish(pool, "t1", second, fill=5)
    states = pool.prefix_cache.final_states
    assert len(states) == 1 and states.kept == 2
    assert states.find(second + [16]).num_tokens == len(second)
    assert pool.usage()["slots"].cached == 1


def test_a_state_gives_up_its_slot_when_a_request_needs_the_room():
    pool = decode_pool()
    i = 0
    while pool.can_reserve(6):  # states fill the pool
        assert finish(pool, f"c{i}", [100 + i] * 6, fill=i + 1)
        i += 1
    assert i >= 2 and not pool.can_reserve(6)
    states = pool.prefix_cache.final_states
    kept = len(states)
    states.find([100] * 7)  # find is read-only: c0 stays the least recently used
    assert pool.make_room(6)  # a new request's room comes from the least recently used state
    pool.reserve("new", 6)
    assert len(states) < kept and states.find([100] * 7) is None
    # Every state that went was evicted (the prompts are distinct: none superseded another), and the
    # cache counts each, with its partial page, whether a request or a newer state needed the unit.
    gone = states.kept - len(states)
    assert gone >= 1 and states.evicted == (gone, gone) and pool.prefix_cache.evicted[1] == gone
    pool.check_invariants()
    balanced(pool)
    pool.release("new")
    pool.prefix_cache.drop_all()
    assert all(u.held == 0 for u in pool.usage().values())


def test_no_state_is_kept_when_no_unit_is_free_and_none_can_go():
    pool = decode_pool()
    live = 0
    while pool.can_reserve(4):  # live requests take every unit
        pool.reserve(f"live{live}", 4)
        live += 1
    pool.prefix_cache.cache_request("live0", [9, 9, 9, 9])
    before = pool.usage()
    assert not pool.prefix_cache.final_states.keep("live0", [9, 9, 9, 9])
    assert pool.usage() == before  # a refused keep takes nothing
    pool.check_invariants()
    balanced(pool)
