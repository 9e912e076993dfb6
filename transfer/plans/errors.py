"""What a plan refuses, as facts: which table, which row or unit, the sizes on each side.

Each is a ValueError (a caller's or a peer's table that cannot be planned), picklable with its fields."""

from __future__ import annotations

from distpool.facts import Facts

# What is wrong with a range table (`RangesRefused.problem`).
BAD_SHAPE = "bad_shape"  # not an (n, 2) int64 tensor; `shape` says what it is
EMPTY = "empty"  # no rows: an envelope holds at least one byte range
NEGATIVE = "negative"  # a negative offset or a non-positive nbytes
PAST_ARENA = "past_arena"  # a row reaches byte `reach`, past the arena's `arena_bytes`
OVERLAPPING = "overlapping"  # two rows share a byte


class RangesRefused(Facts, ValueError):
    """The range table `name` cannot be planned: `problem` (one of the names above); `shape` for
    BAD_SHAPE, `reach` and `arena_bytes` for PAST_ARENA."""

    def __init__(
        self, name: str, problem: str, *, shape: str = "", reach: int = 0, arena_bytes: int = 0
    ) -> None:
        self.name, self.problem, self.shape = name, problem, shape
        self.reach, self.arena_bytes = reach, arena_bytes
        super().__init__(self._describe())

    def _describe(self) -> str:
        name = self.name
        if self.problem == BAD_SHAPE:
            return f"{name} must be an (n, 2) int64 tensor of (offset, nbytes), got {self.shape}"
        if self.problem == EMPTY:
            return f"{name} is empty: an envelope holds at least one byte range"
        if self.problem == NEGATIVE:
            return f"{name} has a negative offset or a non-positive nbytes"
        if self.problem == PAST_ARENA:
            return f"{name} reaches byte {self.reach} past the arena's {self.arena_bytes}"
        return f"{name} has overlapping rows: one byte cannot belong to two positions"


class RowsDoNotPair(Facts, ValueError):
    """A source and a destination table that cannot pair row with row: `src_rows` / `dst_rows`
    rows; when the counts agree, row `row` holds `src_bytes` at the source and `dst_bytes` at the
    destination (the first row that differs)."""

    def __init__(
        self, src_rows: int, dst_rows: int, *, row: int | None = None, src_bytes: int = 0, dst_bytes: int = 0
    ) -> None:
        self.src_rows, self.dst_rows = src_rows, dst_rows
        self.row, self.src_bytes, self.dst_bytes = row, src_bytes, dst_bytes
        if row is None:
            message = (
                f"source has {src_rows} rows and destination {dst_rows}: "
                "the envelopes do not pair (different page counts or layouts)"
            )
        else:
            message = (
                f"row {row} has {src_bytes} bytes at the source and {dst_bytes} at the destination: "
                "the layouts differ"
            )
        super().__init__(message)


class UnitSizesDiffer(Facts, ValueError):
    """Rank `rank` of TP `tp` holds units of `kind` ("slot", "page", "swa_page") of `sizes` bytes,
    where its shard makes them `expected`: its pool was not built from its shard's spec (with the
    run's dtypes and page size)."""

    def __init__(self, rank: int, tp: int, kind: str, sizes: list[int], expected: int) -> None:
        self.rank, self.tp, self.kind, self.sizes, self.expected = rank, tp, kind, list(sizes), expected
        super().__init__(
            f"rank {rank} of TP {tp} holds {kind}s of {self.sizes} bytes, but its shard makes them {expected}"
        )


# Why two TP layouts, or their ranks' unit tables, cannot be planned (`LayoutsDoNotPair.problem`).
RANKS_NOT_IN_ORDER = "ranks_not_in_order"  # `side`'s layout is not ranks 0..tp-1 of one TP size
DIFFERENT_MODELS = "different_models"  # the two layouts shard different models
TABLES_PER_RANK = "tables_per_rank"  # not one unit table per rank on each side
UNIT_COUNTS_DIFFER = "unit_counts_differ"  # the ranks' envelopes hold different numbers of units


class LayoutsDoNotPair(Facts, ValueError):
    """A reshard plan refused: `problem` (one of the names above); `side` ("source" or
    "destination") for RANKS_NOT_IN_ORDER; `counts`, the (kind, units) seen, for UNIT_COUNTS_DIFFER."""

    def __init__(self, problem: str, *, side: str = "", counts: tuple[tuple[str, int], ...] = ()) -> None:
        self.problem, self.side, self.counts = problem, side, tuple(sorted(counts))
        super().__init__(self._describe())

    def _describe(self) -> str:
        if self.problem == RANKS_NOT_IN_ORDER:
            return f"the {self.side} layout must list ranks 0..tp-1 of one TP size, in order"
        if self.problem == DIFFERENT_MODELS:
            return "the source and destination layouts shard different models"
        if self.problem == TABLES_PER_RANK:
            return "give one unit table per rank on each side"
        return f"the ranks' envelopes do not pair: units per kind {list(self.counts)}"
