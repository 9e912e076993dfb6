"""Checks of a batch of (request_id, count) entries, and what a check keeps for the next one.

A decode step extends every running request by one token, and the next step sends the same ids
again: `RequestTable.checked_rows` keeps the checked ids, their rows and one checked batch
(`CheckedIds`), so a repeat costs a comparison and a pass over the counts' types instead of the
lookups. Counts must be exact ints (a bool equals 1 but is no count), hence `plain_ints`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


def checked_counts(ids: Sequence[str], counts: Sequence[int], what: str) -> np.ndarray:
    """The token counts of requests `ids` as int64; raises ValueError unless each is a
    non-negative int (a bool is not a count)."""
    if not plain_ints(counts):
        for rid, n in zip(ids, counts, strict=True):
            if not isinstance(n, numbers.Integral) or isinstance(n, bool):
                raise ValueError(f"{what} {rid!r}: token count must be a non-negative int; got {n!r}")
        counts = [int(n) for n in counts]
    array = np.fromiter(counts, dtype=np.int64, count=len(counts))
    if array.size and array.min() < 0:
        i = int(np.flatnonzero(array < 0)[0])
        raise ValueError(f"{what} {ids[i]!r}: token count must be a non-negative int; got {counts[i]!r}")
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
