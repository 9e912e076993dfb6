"""The table of live requests: what each one holds, as virtual ids, one row per request.

Who owns which token range (the allocator's contract) is stored here as plain data:
- `num_tokens[row]` and `pins[row]` are numpy columns, so a decode step reads and updates the token
  counts of every running request with a few array operations instead of a Python loop;
- `vslot[row]` is the low-band virtual id of the request's slot (-1: none), and `last_vpage[row]`
  the virtual id of its last full page (-1: none), so growth finds where each request ends at once;
- `room[row]`: pages of growth the request still expects (from the final length it announced at
  reserve), which placement keeps free after its last page where it can;
- `vpages[row]` / `vswa[row]` are Python lists of virtual ids in token order (full pages; the
  sliding window's pages), so growth appends in O(1).
Rows of released requests are reused; the columns double when the table fills. Batch lookups and
checks run in C where they can (itemgetter, set, map), since a decode step looks up every running
request; a decode step that repeats the previous step's batch reuses its checked ids and rows
(`checked_rows`) until the id -> row mapping changes (`generation`).
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import chain
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from distpool.memory.errors import (
    DuplicateRequest,
    NotPinned,
    RequestPinned,
    TokenCountInvalid,
    UnknownRequest,
)

# Checks of a batch of (request_id, count) entries, and what a check keeps for the next one.
#
# A decode step extends every running request by one token, and the next step sends the same ids
# again: `RequestTable.checked_rows` keeps the checked ids, their rows and one checked batch
# (`CheckedIds`), so a repeat costs a comparison and a pass over the counts' types instead of the
# lookups. Counts must be exact ints (a bool equals 1 but is no count), hence `plain_ints`.


def checked_counts(ids: Sequence[str], counts: Sequence[int], what: str) -> np.ndarray:
    """The token counts of requests `ids` as int64; raises TokenCountInvalid unless each is a
    non-negative int (a bool is not a count)."""
    if not plain_ints(counts):
        for rid, n in zip(ids, counts, strict=True):
            if not isinstance(n, numbers.Integral) or isinstance(n, bool):
                raise TokenCountInvalid(what, rid, n)
        counts = [int(n) for n in counts]
    array = np.fromiter(counts, dtype=np.int64, count=len(counts))
    if array.size and array.min() < 0:
        i = int(np.flatnonzero(array < 0)[0])
        raise TokenCountInvalid(what, ids[i], counts[i])
    return array


def plain_ints(values: Sequence[object]) -> bool:
    """Whether every value is exactly an int (not a bool, not a numpy integer). A plain loop: on
    CPython 3.11 its `type(v) is int` is specialized, and it measured twice as fast as a set of
    map(type, ...) over a decode step's counts."""
    for v in values:
        if type(v) is not int:
            return False
    return True


def plain_int_counts(requests: Sequence[tuple[str, int]]) -> bool:
    """`plain_ints` of the counts of (request_id, count) entries (2-tuples)."""
    for _, n in requests:
        if type(n) is not int:
            return False
    return True


class CheckedIds(NamedTuple):
    """The ids of a batch that passed `checked_rows` (distinct, live), their rows, the table
    generation they were looked up in, and one checked batch of those ids with its counts."""

    generation: int
    ids: tuple[str, ...]
    rows: np.ndarray  # read-only int64
    # The batch whose counts are kept, as tuples (a snapshot its caller cannot change); None until
    # the ids come again, so a batch that changes every step costs no copy.
    entries: list[tuple] | None
    counts: np.ndarray  # that batch's counts, read-only int64


def concat_ids(lists: Sequence[list[int]]) -> np.ndarray:
    """The virtual ids of several lists, one int64 array."""
    return np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=sum(map(len, lists)))


def repeated(ids: Sequence[str]) -> str:
    """The first id of `ids` that appears more than once (the caller has seen that one does)."""
    return next(rid for rid, n in Counter(ids).items() if n > 1)


def checked_batch(requests: Sequence[tuple[str, int]], what: str) -> tuple[tuple[str, ...], np.ndarray]:
    """(ids, token counts as int64) of a batch of (request_id, count); raises DuplicateRequest or
    TokenCountInvalid before anything changes."""
    ids, counts = zip(*requests, strict=True) if requests else ((), ())
    if len(set(ids)) != len(ids):
        raise DuplicateRequest(what, repeated(ids), in_batch=True)
    return ids, checked_counts(ids, counts, what)


_NO_ROWS = np.empty(0, dtype=np.int64)


class RequestTable:
    """Rows of live requests, keyed by request id (iterating yields request ids)."""

    def __init__(self, capacity: int = 64) -> None:
        self.rows: dict[str, int] = {}
        self.num_tokens = np.zeros(capacity, dtype=np.int64)
        self.pins = np.zeros(capacity, dtype=np.int64)
        self.vslot = np.full(capacity, -1, dtype=np.int64)
        self.last_vpage = np.full(capacity, -1, dtype=np.int64)
        self.room = np.zeros(capacity, dtype=np.int64)  # pages of growth the request still expects
        self.vpages: list[list[int]] = [[] for _ in range(capacity)]
        self.vswa: list[list[int]] = [[] for _ in range(capacity)]
        self._unused_rows = list(range(capacity - 1, -1, -1))
        self.num_pinned = 0  # requests with a pin: batch lookups skip the pin check while it is 0
        # Bumped whenever the id -> row mapping changes (`add`, `remove`: the only writers of `rows`),
        # so a checked batch from an older generation is never reused.
        self.generation = 0
        self._last_ids: CheckedIds | None = None
        self._ones = np.ones(0, dtype=np.int64)  # read-only: the counts of a decode step (see checked_rows)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.rows

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, request_id: str, num_tokens: int, vslot: int, vpages: list[int], vswa: list[int]) -> None:
        if not self._unused_rows:
            self._grow()
        row = self._unused_rows.pop()
        self.rows[request_id] = row
        self.generation += 1
        self.num_tokens[row], self.pins[row], self.vslot[row] = num_tokens, 0, vslot
        self.last_vpage[row] = vpages[-1] if vpages else -1
        self.room[row] = 0
        self.vpages[row], self.vswa[row] = vpages, vswa

    def remove(self, request_ids: Sequence[str]) -> None:
        self.generation += 1
        for rid in request_ids:
            row = self.rows.pop(rid)
            self.vpages[row], self.vswa[row] = [], []
            self._unused_rows.append(row)

    def row(self, request_id: str) -> int:
        try:
            return self.rows[request_id]
        except KeyError:
            raise UnknownRequest(request_id) from None

    def unpinned_rows(self, request_ids: Sequence[str], what: str) -> np.ndarray:
        """Rows of live, unpinned requests; raises UnknownRequest or RequestPinned otherwise."""
        found = self._live_rows_of(request_ids)
        self._check_unpinned(request_ids, found, what)
        return found

    def checked_rows(
        self, requests: Sequence[tuple[str, int]], what: str
    ) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        """(ids, counts, rows) of a batch of (request_id, count) over live, unpinned requests: the
        checks and errors of `checked_batch` then `unpinned_rows`, raised before anything changes.
        `counts` and `rows` are read-only (later calls may hand out the same arrays).

        Decode steps send the same ids step after step. While no request was added or removed
        (`generation`), ids equal to those of the batch that last looked rows up are distinct and
        live, with the same rows: only the counts and the pins are checked again. The second such
        batch is also kept entry by entry; a later batch equal to it, with plain-int counts, has its
        counts as well: then the checks are one comparison (in C), one pass over the counts' types
        and the pin check."""
        last = self._last_ids
        if last is not None and last.generation == self.generation:
            if (
                last.entries is not None
                and type(requests) is list
                and last.entries == requests
                # Equal is not enough for a count: True == 1 and 1.0 == 1, which checked_batch refuses.
                and plain_int_counts(requests)
            ):
                self._check_unpinned(last.ids, last.rows, what)
                return last.ids, last.counts, last.rows
            ids, counts = zip(*requests, strict=True) if requests else ((), ())
            if last.ids == ids:
                added = self._counts_of(ids, counts, what)
                self._check_unpinned(last.ids, last.rows, what)
                if last.entries is None:  # the ids came again: keep this batch (as tuples: unchangeable)
                    self._last_ids = last._replace(entries=list(map(tuple, requests)), counts=added)
                return last.ids, added, last.rows
        else:
            ids, counts = zip(*requests, strict=True) if requests else ((), ())
        if len(set(ids)) != len(ids):
            raise DuplicateRequest(what, repeated(ids), in_batch=True)
        if not ids:
            return ids, np.empty(0, dtype=np.int64), _NO_ROWS
        added = self._counts_of(ids, counts, what)  # before the lookup: checked_batch's order of errors
        rows = self._live_rows_of(ids)
        rows.flags.writeable = False
        self._last_ids = CheckedIds(self.generation, ids, rows, None, added)
        self._check_unpinned(ids, rows, what)  # pins change without a new generation: checked each time
        return ids, added, rows

    def _counts_of(self, ids: tuple[str, ...], counts: tuple[int, ...], what: str) -> np.ndarray:
        """`checked_counts`, read-only; counts that are all 1 (a decode step) as one shared array."""
        # Plain ints equal to 1 are each the int 1 (True == 1 too, but it fails the type check).
        if plain_ints(counts) and counts.count(1) == len(counts):
            return self._ones_of(len(counts))
        added = checked_counts(ids, counts, what)
        added.flags.writeable = False
        return added

    def _ones_of(self, n: int) -> np.ndarray:
        """A read-only int64 array of `n` ones (a view of one shared array)."""
        if self._ones.size < n:
            self._ones = np.ones(max(n, 2 * self._ones.size), dtype=np.int64)
            self._ones.flags.writeable = False
        return self._ones[:n]

    def _live_rows_of(self, request_ids: Sequence[str]) -> np.ndarray:
        """Rows of `request_ids` (at least one); raises UnknownRequest for an id not in the table."""
        try:  # itemgetter looks every id up in C
            found = (
                itemgetter(*request_ids)(self.rows) if len(request_ids) > 1 else [self.rows[request_ids[0]]]
            )
        except KeyError as missing:
            raise UnknownRequest(missing.args[0]) from None
        return np.fromiter(found, dtype=np.int64, count=len(request_ids))

    def _check_unpinned(self, request_ids: Sequence[str], rows: np.ndarray, what: str) -> None:
        if self.num_pinned:
            pins = self.pins[rows]
            if pins.any():
                rid = request_ids[int(np.flatnonzero(pins)[0])]
                raise RequestPinned(what, rid)

    def pin(self, request_id: str) -> None:
        row = self.row(request_id)
        self.num_pinned += int(self.pins[row] == 0)
        self.pins[row] += 1

    def unpin(self, request_id: str) -> None:
        row = self.row(request_id)
        if self.pins[row] == 0:
            raise NotPinned(request_id)
        self.pins[row] -= 1
        self.num_pinned -= int(self.pins[row] == 0)

    def pinned_rows(self) -> list[int]:
        rows = self.live_rows()
        return rows[self.pins[rows] > 0].tolist()

    def held(self, rows: list[int]) -> tuple[int, int]:
        """(low units, pages) held by `rows`."""
        low = sum(int(self.vslot[r] >= 0) + len(self.vswa[r]) for r in rows)
        return low, sum(len(self.vpages[r]) for r in rows)

    def held_ids(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(low-band, high-band) virtual ids held by `rows`."""
        slots = self.vslot[rows]
        rows = rows.tolist()
        low = np.concatenate([slots[slots >= 0], concat_ids([self.vswa[r] for r in rows])])
        return low, concat_ids([self.vpages[r] for r in rows])

    def append_pages(self, rows: np.ndarray, counts: np.ndarray, vpages: np.ndarray) -> None:
        """Append `counts[i]` (>= 1) of `vpages` (in order) to row i's pages."""
        held = self.vpages
        if vpages.size == counts.size:  # a decode step: one page each
            self.last_vpage[rows] = vpages
            # A plain loop: CPython specializes `list.append` here, which beat map/deque when measured.
            for r, v in zip(rows.tolist(), vpages.tolist(), strict=True):
                held[r].append(v)
            return
        self.last_vpage[rows] = vpages[np.cumsum(counts) - 1]
        at = 0
        for r, k in zip(rows.tolist(), counts.tolist(), strict=True):
            held[r] += vpages[at : at + k].tolist()
            at += k

    def slide_windows(
        self, rows: np.ndarray, drops: np.ndarray, counts: np.ndarray, vswa: np.ndarray
    ) -> None:
        """Drop the first `drops[i]` window pages of row i and append `counts[i]` of `vswa`."""
        at = 0
        for r, d, k in zip(rows.tolist(), drops.tolist(), counts.tolist(), strict=True):
            self.vswa[r] = self.vswa[r][d:] + vswa[at : at + k].tolist()
            at += k

    def check(self, require) -> None:
        """The table's own invariants, reported through `require(ok, code, statement, subject)`."""
        for rid, r in self.rows.items():
            require(self.pins[r] >= 0, "pins-non-negative", "pin count is non-negative", rid)
            last = self.vpages[r][-1] if self.vpages[r] else -1
            require(
                self.last_vpage[r] == last, "last-page", "the last page is recorded where growth starts", rid
            )
        require(
            self.num_pinned == int((self.pins > 0).sum()),
            "pinned-count",
            "the pinned-request count matches the pins",
        )

    def live_rows(self) -> np.ndarray:
        return np.fromiter(self.rows.values(), dtype=np.int64, count=len(self.rows))

    def _grow(self) -> None:
        old = self.num_tokens.size
        self.num_tokens = np.concatenate([self.num_tokens, np.zeros(old, dtype=np.int64)])
        self.pins = np.concatenate([self.pins, np.zeros(old, dtype=np.int64)])
        self.vslot = np.concatenate([self.vslot, np.full(old, -1, dtype=np.int64)])
        self.last_vpage = np.concatenate([self.last_vpage, np.full(old, -1, dtype=np.int64)])
        self.room = np.concatenate([self.room, np.zeros(old, dtype=np.int64)])
        self.vpages += [[] for _ in range(old)]
        self.vswa += [[] for _ in range(old)]
        self._unused_rows = list(range(2 * old - 1, old - 1, -1))
