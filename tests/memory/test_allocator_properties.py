"""Random interleavings of reserve / extend / release / compact / pin / unpin on every pool kind.

After every step: the accounting invariants hold, and every live unit still holds the bytes written
when it was handed out (a pattern derived from request, unit kind and token-page index), so neither
compaction nor any other request's activity may disturb a live envelope. Capacity answers are
checked against what happens: `can_reserve` predicts a reserve, `NeedsCompaction` promises that a
reserve or extend succeeds after `compact()`, and a unified pool with nothing pinned never refuses
(plain `DoesNotFit`) while its free bytes cover the request: compaction reclaims every hole, so the
allocator must say `NeedsCompaction` instead. Reserves and extends with `compact=True` (and final
lengths as growth hints) exercise the targeted compactions (the requests in the way move, or one
stretch of pages slides up; a growth may clear the pages after its request) and the slides that
keep growth room; the byte check covers their copy order. Both placements (extent, first fit) run.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from distpool.memory.pool import DoesNotFit, NeedsCompaction, RequestPinned
from distpool.model.spec import DENSE, HYBRID_SWA
from tests.factories import accounting, free_units, make_spec
from tests.memory.placed_pool import free_bytes, make_placed_pool, unit_bytes

# (name, spec factory arguments, pool arguments): small arenas so that pools fill up often.
CONFIGS = {
    "unified_mamba": (None, {"unified": True, "budget_bytes": 12288}),
    "unified_mamba_first_fit": (None, {"unified": True, "budget_bytes": 12288, "placement": "first_fit"}),
    "static_mamba": (None, {"unified": False, "budget_bytes": 12288}),
    "unified_swa": ({"kind": HYBRID_SWA, "sliding_window": 6}, {"unified": True, "budget_bytes": 12288}),
    "unified_swa_first_fit": (
        {"kind": HYBRID_SWA, "sliding_window": 6},
        {"unified": True, "budget_bytes": 12288, "placement": "first_fit"},
    ),
    "static_swa": ({"kind": HYBRID_SWA, "sliding_window": 6}, {"unified": False, "budget_bytes": 12288}),
    "dense": ({"kind": DENSE}, {"unified": False, "budget_bytes": 12288}),
}
TOKENS = st.integers(min_value=0, max_value=16)


def _pattern(key: tuple[int, str, int], nbytes: int) -> torch.Tensor:
    request, kind, index = key
    seed = (request * 7919 + {"slot": 1, "page": 2, "swa": 3}[kind] * 104729 + index * 31) % 251
    return ((torch.arange(nbytes, dtype=torch.int64) * 13 + seed) % 251).to(torch.uint8)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = None
        self.numbers: dict[str, int] = {}  # request id -> number used in its byte pattern
        self.pins: dict[str, int] = {}
        self.next_number = 0

    # Unified pools twice as often: only they compact.
    @initialize(config=st.sampled_from([*sorted(CONFIGS), "unified_mamba", "unified_swa"]))
    def build(self, config: str) -> None:
        spec_args, pool_args = CONFIGS[config]
        self.pool = make_placed_pool(make_spec(**spec_args) if spec_args else None, **pool_args)
        self.fresh = free_units(self.pool)

    # ---- helpers -----------------------------------------------------------------------------
    def _units(self, rid: str) -> list[tuple[tuple[int, str, int], int, int]]:
        """((request number, kind, token-page index), offset, nbytes) for each envelope row."""
        rows = self.pool.envelope_ranges(rid).tolist()
        kinds = ["slot"] if self.pool.slot_id(rid) is not None else []
        kinds += ["page"] * self.pool.page_ids(rid).numel()
        num_swa = (
            self.pool.swa_page_ids(rid).numel()
            if self.pool.arena.low and self.pool.arena.low.name == "swa_pages"
            else 0
        )
        first = self.pool.swa_first_page(rid)
        assert len(rows) == len(kinds) + num_swa
        keys = [(k, kinds[:i].count(k)) for i, k in enumerate(kinds)] + [
            ("swa", first + j) for j in range(num_swa)
        ]
        return [((self.numbers[rid], k, i), off, n) for (k, i), (off, n) in zip(keys, rows, strict=True)]

    def _write_new(self, rid: str, old: set) -> None:
        for key, offset, nbytes in self._units(rid):
            if key not in old:
                self.pool.buffer[offset : offset + nbytes] = _pattern(key, nbytes)

    def _live(self) -> list[str]:
        return sorted(self.numbers)

    def _assert_no_room(self, low_units: int, pages: int) -> None:
        """A plain refusal (not NeedsCompaction) in a unified pool with nothing pinned: the request's
        bytes must exceed the free bytes, which compaction would otherwise have gathered."""
        if self.pool.kind == "unified" and not any(self.pins.values()):
            need = unit_bytes(self.pool, low_units, pages)
            assert need > free_bytes(self.pool), f"refused with room: needs {need} of {free_bytes(self.pool)}"

    # ---- rules -------------------------------------------------------------------------------
    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=3))
    def reserve(self, tokens: list[int]) -> None:
        ids = [f"r{self.next_number + i}" for i in range(len(tokens))]
        predicted = self.pool.can_reserve(tokens[0]) if len(tokens) == 1 else None
        before = accounting(self.pool)
        try:
            self.pool.reserve_batch(list(zip(ids, tokens, strict=True)))
        except NeedsCompaction:
            assert accounting(self.pool) == before, "a refused reserve took something"
            if len(tokens) == 1:
                assert self.pool.can_reserve(tokens[0], compact=True)
            self.compact()
            self.pool.reserve_batch(list(zip(ids, tokens, strict=True)))  # promised to fit now
        except DoesNotFit:
            assert accounting(self.pool) == before, "a refused reserve took something"
            assert predicted is not True, "can_reserve said yes"
            if len(tokens) == 1:
                assert not self.pool.can_reserve(tokens[0], compact=True)
            allocator = self.pool.allocator
            low = sum(allocator.low_units_for(n) for n in tokens)
            self._assert_no_room(low, sum(allocator.pages_for(n) for n in tokens))
            return
        else:
            assert predicted is not False, "can_reserve said no"
        for rid in ids:
            self.numbers[rid] = self.next_number
            self.next_number += 1
            self._write_new(rid, set())

    @rule(
        tokens=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=3),
        growth=st.integers(min_value=0, max_value=24),
    )
    def reserve_compacting(self, tokens: list[int], growth: int) -> None:
        """Reserve as a server does: compacting when that makes room (only the requests in the way
        move, or everything), with each request's final length as a placement hint."""
        ids = [f"r{self.next_number + i}" for i in range(len(tokens))]
        before = accounting(self.pool)
        finals = [n + growth for n in tokens]
        try:
            self.pool.reserve_batch(list(zip(ids, tokens, strict=True)), compact=True, final_tokens=finals)
        except NeedsCompaction:
            raise AssertionError("a compacting reserve may only refuse for want of room") from None
        except DoesNotFit:
            assert accounting(self.pool) == before, "a refused reserve took something"
            allocator = self.pool.allocator
            low = sum(allocator.low_units_for(n) for n in tokens)
            self._assert_no_room(low, sum(allocator.pages_for(n) for n in tokens))
            return
        for rid in ids:
            self.numbers[rid] = self.next_number
            self.next_number += 1
            self._write_new(rid, set())

    @precondition(lambda self: self.numbers)
    @rule(data=st.data(), more=st.integers(min_value=1, max_value=12))
    def extend_compacting(self, data, more: int) -> None:
        rid = data.draw(st.sampled_from(self._live()))
        if self.pins.get(rid, 0):
            return
        old = {key for key, _, _ in self._units(rid)}
        before = accounting(self.pool)
        try:
            self.pool.extend(rid, more, compact=True)
        except NeedsCompaction:
            raise AssertionError("a compacting extend may only refuse for want of room") from None
        except DoesNotFit:
            assert accounting(self.pool) == before, "a refused extend took something"
            return
        self._write_new(rid, old)

    @rule(tokens=st.integers(min_value=17, max_value=48))
    def reserve_long(self, tokens: int) -> None:
        """One long request: in a fragmented arena only compaction makes room for it."""
        self.reserve([tokens])

    @precondition(lambda self: self.numbers)
    @rule(data=st.data(), more=st.integers(min_value=0, max_value=9))
    def extend(self, data, more: int) -> None:
        rid = data.draw(st.sampled_from(self._live()))
        old = {key for key, _, _ in self._units(rid)}
        before = accounting(self.pool)
        try:
            self.pool.extend(rid, more)
        except RequestPinned:
            assert self.pins.get(rid, 0) > 0 and accounting(self.pool) == before
            return
        except NeedsCompaction:
            assert accounting(self.pool) == before, "a refused extend took something"
            self.compact()
            self.pool.extend(rid, more)  # promised to fit now
        except DoesNotFit:
            assert accounting(self.pool) == before, "a refused extend took something"
            allocator, n = self.pool.allocator, self.pool.num_tokens(rid)
            first, end = allocator.swa_range(n)
            new_first, new_end = allocator.swa_range(n + more)
            new_window = max(new_end - max(end, new_first), 0)  # the window pages it would add
            self._assert_no_room(new_window, allocator.pages_for(n + more) - allocator.pages_for(n))
            return
        assert self.pins.get(rid, 0) == 0
        self._write_new(rid, old)

    @precondition(lambda self: self.numbers)
    @rule(data=st.data())
    def release(self, data) -> None:
        rid = data.draw(st.sampled_from(self._live()))
        try:
            self.pool.release(rid)
        except RequestPinned:
            assert self.pins.get(rid, 0) > 0
            return
        del self.numbers[rid]

    @precondition(lambda self: len(self.numbers) >= 2)
    @rule()
    def release_every_other(self) -> None:
        """Free every other unpinned request (oldest first): holes in both bands."""
        victims = [r for r in sorted(self.numbers, key=self.numbers.get) if not self.pins.get(r)][::2]
        self.pool.release_batch(victims)
        for rid in victims:
            del self.numbers[rid]

    @precondition(lambda self: self.numbers)  # an empty pool has nothing to move
    @rule()
    def compact(self) -> None:
        pinned = [r for r, n in self.pins.items() if n]
        before = {r: self.pool.envelope_ranges(r).tolist() for r in pinned}
        moved = self.pool.compact()
        assert before == {r: self.pool.envelope_ranges(r).tolist() for r in pinned}, "a pinned envelope moved"
        assert moved >= 0 and (moved == 0 or self.pool.kind == "unified")
        if self.pool.kind == "unified" and not any(self.pins.values()):
            moves = self.pool.allocator.compaction_moves()
            assert moves.bytes_moved == 0, "compaction without pins leaves a packed arena"

    @precondition(lambda self: self.numbers)
    @rule(data=st.data())
    def pin(self, data) -> None:
        rid = data.draw(st.sampled_from(self._live()))
        self.pool.pin(rid)
        self.pins[rid] = self.pins.get(rid, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, n in self.pins.items() if n)))
        self.pool.unpin(rid)
        self.pins[rid] -= 1

    @precondition(lambda self: len(self.numbers) >= 3)
    @rule()
    def drain(self) -> None:
        for rid, n in self.pins.items():
            for _ in range(n):
                self.pool.unpin(rid)
        self.pins.clear()
        self.pool.release_batch(self._live())
        self.numbers.clear()
        assert free_units(self.pool) == self.fresh, "memory leaked after releasing everything"

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def accounting_holds(self) -> None:
        if self.pool is not None:
            self.pool.check_invariants()
            assert sorted(self.pool.request_ids) == self._live()

    @invariant()
    def live_bytes_survive(self) -> None:
        if self.pool is None:
            return
        for rid in self._live():
            for key, offset, nbytes in self._units(rid):
                assert torch.equal(self.pool.buffer[offset : offset + nbytes], _pattern(key, nbytes)), (
                    rid,
                    key,
                )


PoolMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestPoolInterleavings = PoolMachine.TestCase
