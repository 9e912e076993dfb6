"""The pool's prefix cache: shared pages by reference, checkpoints, eviction before refusal.

Bytes: every page written holds a pattern of its token prefix (like the synthetic cache: equal
prefixes, equal bytes), every checkpoint a pattern of its depth's prefix, so sharing, compaction and
eviction can be checked byte for byte: a page some request or the cache still holds never changes.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from distpool.memory.arena_pool import ArenaPool
from distpool.memory.errors import KeepsNoCheckpoints
from distpool.memory.pool import DoesNotFit, RequestPinned
from tests.factories import make_sizes

PAGE = 4  # tokens per page in tests.factories' sizes


def _pattern(tokens: tuple[int, ...], nbytes: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(repr(tokens).encode(), digest_size=4).digest(), "little")
    return ((torch.arange(nbytes, dtype=torch.int64) * 31 + seed) % 251).to(torch.uint8)


def _pool(budget: int = 24576) -> ArenaPool:
    return ArenaPool(make_sizes(budget_bytes=budget), "cpu", prefix_cache=True)


def _write_pages(pool: ArenaPool, rid: str, tokens: list[int], first: int = 0) -> None:
    """Page k of `rid` holds the pattern of tokens[: (k + 1) * PAGE] (from page `first` on)."""
    stride = pool.arena.high.stride_bytes
    for k, page in enumerate(pool.page_ids(rid).tolist()):
        if k >= first:
            offset = pool.arena.high.base_bytes + page * stride
            pool.buffer[offset : offset + stride] = _pattern(tuple(tokens[: (k + 1) * PAGE]), stride)


def _page_ok(pool: ArenaPool, page: int, tokens: tuple[int, ...]) -> bool:
    stride = pool.arena.high.stride_bytes
    offset = pool.arena.high.base_bytes + page * stride
    return torch.equal(pool.buffer[offset : offset + stride], _pattern(tokens, stride))


def _write_checkpoint(pool: ArenaPool, slot: int, tokens: tuple[int, ...]) -> None:
    stride = pool.arena.low.stride_bytes
    offset = pool.arena.low.base_bytes + slot * stride
    pool.buffer[offset : offset + stride] = _pattern(("state", *tokens), stride)


def test_a_cached_prefix_is_shared_by_reference_and_outlives_its_first_owner():
    pool = _pool()
    cache = pool.prefix_cache
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    pool.reserve("a", len(prompt))
    _write_pages(pool, "a", prompt)
    handle, slot = cache.take_checkpoint()
    _write_checkpoint(pool, slot, tuple(prompt[:8]))
    cache.cache_request("a", prompt, {2: handle})
    match = cache.match(prompt[:8] + [42, 43])
    assert match.num_tokens == 8 and match.checkpoint == handle
    pool.reserve("b", 10, prefix=match)
    assert pool.page_ids("b")[:2].tolist() == pool.page_ids("a")[:2].tolist()  # the same memory
    pages_before = pool.usage()["pages"].held
    pool.release("a")  # b and the cache still hold the first two pages: only a's third page goes
    assert pool.usage()["pages"].held == pages_before - 1
    for k, page in enumerate(pool.page_ids("b")[:2].tolist()):
        assert _page_ok(pool, page, tuple(prompt[: (k + 1) * PAGE]))
    pool.check_invariants()
    pool.release("b")
    assert pool.usage()["pages"].cached == 2 and pool.usage()["slots"].cached == 1
    cache.drop_all()
    assert pool.usage()["pages"].held == 0 and pool.usage()["slots"].held == 0
    pool.check_invariants()


def test_memory_pressure_evicts_idle_cached_pages_instead_of_refusing():
    pool = _pool(budget=8192)
    cache = pool.prefix_cache
    pool.reserve("a", 16)
    cache.cache_request("a", list(range(16)), None)
    pool.release("a")  # its four pages stay cached
    cached = pool.usage()["pages"].cached
    assert cached == 4
    free_pages = pool.available()["pages"]
    pool.reserve("big", (free_pages + 2) * PAGE, compact=True)  # fits only if the cache gives way
    assert cache.evicted[0] >= 2 and pool.usage()["pages"].cached <= cached - 2
    pool.check_invariants()


def test_a_request_finishing_while_its_prefix_sharer_is_in_transfer_frees_nothing_still_held():
    pool = _pool()
    cache = pool.prefix_cache
    prompt = list(range(12))
    pool.reserve("a", 12)
    _write_pages(pool, "a", prompt)
    handle, _ = cache.take_checkpoint()
    cache.cache_request("a", prompt, {2: handle})
    pool.reserve("b", 10, prefix=cache.match(prompt[:8] + [50, 51]))
    pool.pin("b")  # b's envelope is in transfer
    pool.release("a")  # a finishes: its third page is the cache's alone now
    assert cache.evict(100, 100) == 1  # the only idle entry: a's third page; b uses the others
    shared = pool.page_ids("b")[:2].tolist()
    assert all(_page_ok(pool, p, tuple(prompt[: (k + 1) * PAGE])) for k, p in enumerate(shared))
    assert pool.usage()["slots"].cached == 1  # b's match holds the checkpoint's node in use
    with pytest.raises(RequestPinned):
        pool.release("b")
    pool.check_invariants()


def test_compaction_plans_list_each_shared_page_once_and_the_cache_only_pages_too():
    pool = _pool()
    cache = pool.prefix_cache
    prompt = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    pool.reserve("a", 13)
    handle, _ = cache.take_checkpoint()
    cache.cache_request("a", prompt, {3: handle})
    pool.reserve("b", 14, prefix=cache.match(prompt[:12] + [2, 2]))
    pool.reserve("c", 5)
    cache.cache_request("c", [1, 1, 1, 1, 1], None)
    pool.release("c")  # its first page: the cache's alone
    allocator = pool.allocator
    groups, rooms = allocator.sharing.holder_groups(allocator.holdings.live_rows())
    listed = [page for group in groups for page in group.tolist()]
    assert sorted(listed) == sorted(set(listed)), "a page is listed twice: a plan would move it twice"
    owned = sorted(allocator.high_band.v2p[allocator.high_band.v2p >= 0].tolist())
    assert sorted(listed) == owned and len(rooms) == len(groups)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests over a three-token alphabet (prefixes repeat often) reserve with and without a
    cached prefix, cache their pages and checkpoints, grow, pin, leave; the pool compacts and
    evicts. After every step: the accounting and cache invariants, and the bytes of every page a
    request or the cache holds and of every cached checkpoint."""

    @initialize(budget=st.sampled_from([6144, 8192, 12288]), checkpoints=st.booleans())
    def build(self, budget: int, checkpoints: bool) -> None:
        # checkpoints=False: a decode pool's cache (pages only, matched without a checkpoint)
        self.pool = ArenaPool(
            make_sizes(budget_bytes=budget), "cpu", prefix_cache=True, checkpoints=checkpoints
        )
        self.cache = self.pool.prefix_cache
        self.tokens: dict[str, list[int]] = {}
        self.pins: dict[str, int] = {}
        self.cached_prefix: dict[int, tuple[int, ...]] = {}  # cached page handle -> its token prefix
        self.checkpoint_prefix: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def _write_rest(self, rid: str, first: int) -> None:
        _write_pages(self.pool, rid, self.tokens[rid], first)

    @rule(
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=24),
        reuse=st.booleans(),
        compacting=st.booleans(),
    )
    def reserve(self, tokens: list[int], reuse: bool, compacting: bool) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        match = self.cache.match(tokens) if reuse else None
        try:
            self.pool.reserve(rid, len(tokens), prefix=match, compact=compacting)
        except DoesNotFit:
            return
        self.tokens[rid] = list(tokens)
        self._write_rest(rid, len(match.pages) if match else 0)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), checkpoint=st.booleans())
    def cache_request(self, data, checkpoint: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[rid]
        depth = len(tokens) // PAGE
        checkpoints = {}
        if checkpoint and depth and not self.cache.needs_checkpoint:
            with pytest.raises(KeepsNoCheckpoints):  # and nothing is taken
                self.cache.take_checkpoint()
        elif checkpoint and depth:
            try:
                handle, slot = self.cache.take_checkpoint()
            except DoesNotFit:
                return
            _write_checkpoint(self.pool, slot, tuple(tokens[: depth * PAGE]))
            checkpoints = {depth: handle}
        vpages = list(self.pool.allocator.holdings.vpages[self.pool.allocator.holdings.row(rid)])
        adopted = self.cache.cache_request(rid, tokens, checkpoints)
        for handle in adopted.pages:
            self.cached_prefix[handle] = tuple(tokens[: (vpages.index(handle) + 1) * PAGE])
        for handle in adopted.checkpoints:
            self.checkpoint_prefix[handle] = tuple(tokens[: depth * PAGE])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, data, more: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.pins.get(rid):
            return
        old = len(self.tokens[rid])
        try:
            self.pool.extend(rid, len(more), compact=True)
        except DoesNotFit:
            return
        self.tokens[rid] += more
        self._write_rest(rid, old // PAGE)  # the partial last page (never cached) and the new ones

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.pins.get(rid):
            return
        self.pool.release(rid)
        del self.tokens[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def pin(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.pin(rid)
        self.pins[rid] = self.pins.get(rid, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, n in self.pins.items() if n)))
        self.pool.unpin(rid)
        self.pins[rid] -= 1

    @rule(keep_room=st.booleans())
    def compact(self, keep_room: bool) -> None:
        self.pool.compact(keep_room=keep_room)

    @rule(pages=st.integers(0, 8), checkpoints=st.integers(0, 2))
    def evict(self, pages: int, checkpoints: int) -> None:
        self.cache.evict(pages, checkpoints)

    @rule(num_tokens=st.integers(1, 40), compacting=st.booleans())
    def make_room(self, num_tokens: int, compacting: bool) -> None:
        """Eviction makes room exactly when it says so: then the request fits; otherwise nothing
        idle is left to evict, or what is left would not do."""
        fits = self.pool.make_room(num_tokens, compact=compacting)
        assert fits == self.pool.can_reserve(num_tokens, compact=compacting)
        if not fits:
            assert self.cache.evict(1 << 20, 1 << 20) == 0 or not self.pool.can_reserve(
                num_tokens, compact=compacting
            )
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.pool.reserve(rid, num_tokens, compact=compacting)  # what make_room promised: no DoesNotFit
        self.tokens[rid] = [0] * num_tokens
        self._write_rest(rid, 0)

    @invariant()
    def accounting_and_bytes_hold(self) -> None:
        self.pool.check_invariants()
        for rid, tokens in self.tokens.items():
            for k, page in enumerate(self.pool.page_ids(rid).tolist()[: len(tokens) // PAGE]):
                assert _page_ok(self.pool, page, tuple(tokens[: (k + 1) * PAGE])), f"{rid} page {k}"
        allocator = self.pool.allocator
        for handle, prefix in list(self.cached_prefix.items()):
            if not allocator.cached[handle]:
                del self.cached_prefix[handle]  # evicted
                continue
            assert _page_ok(self.pool, int(allocator.high_band.v2p[handle]), prefix), "a cached page changed"
        stride = self.pool.arena.low.stride_bytes
        for handle, prefix in list(self.checkpoint_prefix.items()):
            if not allocator.checkpoint[handle]:
                del self.checkpoint_prefix[handle]
                continue
            offset = self.pool.arena.low.base_bytes + self.cache.checkpoint_slot(handle) * stride
            expected = _pattern(("state", *prefix), stride)
            assert torch.equal(self.pool.buffer[offset : offset + stride], expected), "a checkpoint changed"

    def teardown(self) -> None:
        if getattr(self, "pool", None) is None:
            return
        for rid in list(self.tokens):
            while self.pins.get(rid):
                self.pool.unpin(rid)
                self.pins[rid] -= 1
            self.pool.release(rid)
        self.cache.drop_all()
        usage = self.pool.usage()
        assert all(u.held == 0 for u in usage.values()), f"memory left after dropping the cache: {usage}"


PrefixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_prefix_cache_machine = PrefixCacheMachine.TestCase
