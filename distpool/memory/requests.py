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
request.
"""

from __future__ import annotations

import numbers
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import chain
from operator import itemgetter

import numpy as np

from distpool.memory.pool import DuplicateRequest, RequestPinned, UnknownRequest


def concat_ids(lists: Sequence[list[int]]) -> np.ndarray:
    """The virtual ids of several lists, one int64 array."""
    return np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=sum(map(len, lists)))


def checked_batch(requests: Sequence[tuple[str, int]], what: str) -> tuple[tuple[str, ...], np.ndarray]:
    """(ids, token counts as int64) of a batch of (request_id, count); raises DuplicateRequest or
    ValueError before anything changes."""
    ids, counts = zip(*requests, strict=True) if requests else ((), ())
    if len(set(ids)) != len(ids):
        raise DuplicateRequest(f"{what}: a request id appears twice in one batch: {list(ids)}")
    if not set(map(type, counts)) <= {int}:  # one C pass in the common case of plain ints
        for rid, n in requests:
            if not isinstance(n, numbers.Integral) or isinstance(n, bool):
                raise ValueError(f"{what} {rid!r}: token count must be a non-negative int; got {n!r}")
        counts = [int(n) for n in counts]
    array = np.fromiter(counts, dtype=np.int64, count=len(counts))
    if array.size and array.min() < 0:
        i = int(np.flatnonzero(array < 0)[0])
        raise ValueError(f"{what} {ids[i]!r}: token count must be a non-negative int; got {counts[i]!r}")
    return ids, array


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
        self.num_tokens[row], self.pins[row], self.vslot[row] = num_tokens, 0, vslot
        self.last_vpage[row] = vpages[-1] if vpages else -1
        self.room[row] = 0
        self.vpages[row], self.vswa[row] = vpages, vswa

    def remove(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            row = self.rows.pop(rid)
            self.vpages[row], self.vswa[row] = [], []
            self._unused_rows.append(row)

    def row(self, request_id: str) -> int:
        try:
            return self.rows[request_id]
        except KeyError:
            raise UnknownRequest(f"unknown request {request_id!r}") from None

    def unpinned_rows(self, request_ids: Sequence[str], what: str) -> np.ndarray:
        """Rows of live, unpinned requests; raises UnknownRequest or RequestPinned otherwise."""
        try:  # itemgetter looks every id up in C
            found = (
                itemgetter(*request_ids)(self.rows) if len(request_ids) > 1 else [self.rows[request_ids[0]]]
            )
        except KeyError as missing:
            raise UnknownRequest(f"unknown request {missing.args[0]!r}") from None
        found = np.fromiter(found, dtype=np.int64, count=len(request_ids))
        if self.num_pinned:
            pins = self.pins[found]
            if pins.any():
                rid = request_ids[int(np.flatnonzero(pins)[0])]
                raise RequestPinned(f"{what}: request {rid!r} is pinned by a transfer; unpin it first")
        return found

    def pin(self, request_id: str) -> None:
        row = self.row(request_id)
        self.num_pinned += int(self.pins[row] == 0)
        self.pins[row] += 1

    def unpin(self, request_id: str) -> None:
        row = self.row(request_id)
        if self.pins[row] == 0:
            raise ValueError(f"unpin: request {request_id!r} is not pinned")
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
        """Append `counts[i]` of `vpages` (in order) to row i's pages."""
        self.last_vpage[rows] = vpages[np.cumsum(counts) - 1]
        lists = [self.vpages[r] for r in rows.tolist()]
        if counts.max() == 1:  # a decode step: one page each, appended without a Python loop body
            deque(map(list.append, lists, vpages.tolist()), maxlen=0)
            return
        at = 0
        for held, k in zip(lists, counts.tolist(), strict=True):
            held += vpages[at : at + k].tolist()
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
        """The table's own invariants, reported through `require(ok, invariant)`."""
        for rid, r in self.rows.items():
            require(self.pins[r] >= 0, f"{rid}: pin count is non-negative")
            last = self.vpages[r][-1] if self.vpages[r] else -1
            require(self.last_vpage[r] == last, f"{rid}: the last page is recorded where growth starts")
        require(self.num_pinned == int((self.pins > 0).sum()), "the pinned-request count matches the pins")

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
