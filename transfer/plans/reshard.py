"""The transfer plan between two tensor-parallel layouts: which source rank sends which bytes of a
request's envelope to which destination rank.

Every rank of the prefill group and of the decode group holds its shard of the envelope
(`distpool.model.shard`). Units pair as in the one-rank plan (`plan.py`): the slot, then pages in
token order, then window pages, unit i with unit i. Inside a unit, which source rank sends which
pieces of each tensor (a replicated part from one of its holders) is a template per (source rank,
unit kind), relative to the units' starts (`transfer.plans.unit_templates`); the plan shifts it to every
unit's offsets on both sides and merges what touches.

    plan_reshard(...)  -> (RankRuns(src_rank, dst_rank, runs), ...): runs (m, 3) int64 of
                          (src_offset, dst_offset, nbytes) in the two ranks' arenas, stream order
    plan_pair(...)     -> one (source rank, destination rank) pair's runs, from those two ranks'
                          unit tables alone: what one channel of the transfer engine moves
    source_ranks(...)  -> the source ranks one destination rank needs a channel to

A pure function of both layouts (their `RankShard`s) and both sides' unit tables. With the same
shards on both sides (equal TP), rank r sends its whole units to rank r, exactly as `plan_runs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from distpool.memory.arena import merge_runs
from distpool.memory.sizing import align_up, slot_stride_bytes
from distpool.model.shard import RankShard
from transfer.plans.errors import (
    DIFFERENT_MODELS,
    RANKS_NOT_IN_ORDER,
    TABLES_PER_RANK,
    UNIT_COUNTS_DIFFER,
    LayoutsDoNotPair,
    UnitSizesDiffer,
)
from transfer.plans.plan import moving_rows, plan_runs
from transfer.plans.unit_templates import UNIT_KINDS, assign_pieces, source_preference, unit_templates


@dataclass(frozen=True)
class EnvelopeUnits:
    """One rank's envelope as (offset, nbytes) rows per unit kind, each in canonical order."""

    slot: np.ndarray  # (0 or 1, 2)
    page: np.ndarray  # (P, 2) full-attention pages, token order
    swa_page: np.ndarray  # (S, 2) window pages

    @classmethod
    def from_ranges(
        cls, ranges: torch.Tensor | np.ndarray, *, num_pages: int, has_slot: bool, held_pages: int = 0
    ) -> EnvelopeUnits:
        """Split `Pool.envelope_ranges` rows (slot, `num_pages` pages, window pages), less the first
        `held_pages` pages the destination holds already (`plan.moving_rows`)."""
        table = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        first = int(has_slot)
        if table.shape[0] < first + num_pages:
            raise ValueError(f"{table.shape[0]} rows cannot hold a slot ({has_slot}) and {num_pages} pages")
        table = moving_rows(table, held_pages, has_slot=has_slot)
        pages_end = first + num_pages - held_pages
        return cls(slot=table[:first], page=table[first:pages_end], swa_page=table[pages_end:])

    @property
    def rows(self) -> np.ndarray:
        return np.concatenate([self.slot, self.page, self.swa_page])


@dataclass(frozen=True)
class RankRuns:
    """What one source rank sends one destination rank: (m, 3) runs in stream order."""

    src_rank: int
    dst_rank: int
    runs: np.ndarray  # int64 (src_offset, dst_offset, nbytes), offsets in each rank's arena

    @property
    def nbytes(self) -> int:
        return int(self.runs[:, 2].sum())


@lru_cache(maxsize=256)  # a pure function of the shard, asked for every request's plan
def _unit_bytes(shard: RankShard, kind: str, page_size: int) -> int:
    """The stride of one unit of `kind` in a pool built from the rank's spec."""
    spec = shard.spec
    if kind == "slot":
        return slot_stride_bytes(spec)
    per_token = spec.full_kv_bytes_per_token if kind == "page" else spec.swa_kv_bytes_per_token
    return align_up(page_size * per_token)


def _unit_sizes(shard: RankShard, page_size: int) -> tuple[int, ...]:
    """The rank's unit strides, per UNIT_KINDS."""
    return tuple(_unit_bytes(shard, kind, page_size) for kind in UNIT_KINDS)


def _check_sizes(shard: RankShard, table: EnvelopeUnits, expected: tuple[int, ...]) -> None:
    """Every unit is as large as the rank's shard says (`expected`, per UNIT_KINDS): the pool was
    built from the shard's spec."""
    for kind, nbytes in zip(UNIT_KINDS, expected, strict=True):
        sizes = getattr(table, kind)[:, 1]
        if (sizes != nbytes).any():
            raise UnitSizesDiffer(shard.rank, shard.tp, kind, sorted(set(sizes.tolist())), nbytes)


def _check_units(shards: Sequence[RankShard], units: Sequence[EnvelopeUnits], page_size: int) -> None:
    for shard, table in zip(shards, units, strict=True):
        _check_sizes(shard, table, _unit_sizes(shard, page_size))


def _check_layouts(src_shards: Sequence[RankShard], dst_shards: Sequence[RankShard]) -> None:
    for side, shards in (("source", src_shards), ("destination", dst_shards)):
        if not shards or [(s.tp, s.rank) for s in shards] != [(len(shards), r) for r in range(len(shards))]:
            raise LayoutsDoNotPair(RANKS_NOT_IN_ORDER, side=side)
    if src_shards[0].model != dst_shards[0].model:
        raise LayoutsDoNotPair(DIFFERENT_MODELS)


def source_ranks(
    src_shards: Sequence[RankShard], dst_shards: Sequence[RankShard], dst_rank: int
) -> tuple[int, ...]:
    """The source ranks destination rank `dst_rank` receives bytes from (the channels it needs)."""
    _check_layouts(src_shards, dst_shards)
    dst = dst_shards[dst_rank]
    order = source_preference(len(src_shards), len(dst_shards), dst_rank)
    ranks = {
        rank
        for t in dst.tensors
        if t.nbytes
        for rank, _, _ in assign_pieces(t, [s.tensor(t.name) for s in src_shards], order)
    }
    return tuple(sorted(ranks))


def plan_reshard(
    src_shards: Sequence[RankShard],
    src_units: Sequence[EnvelopeUnits],
    dst_shards: Sequence[RankShard],
    dst_units: Sequence[EnvelopeUnits],
    *,
    page_size: int,
) -> tuple[RankRuns, ...]:
    """Every (source rank, destination rank) pair that moves bytes, with its runs.

    `*_shards[r]` is rank r's shard of one layout (`shard(spec, tp, r)` for r in range(tp)) and
    `*_units[r]` its envelope's units. Each destination rank receives exactly its shard's bytes of
    every unit, each byte once. Raises ValueError when the layouts or the unit tables do not pair.
    """
    _check_layouts(src_shards, dst_shards)
    if len(src_units) != len(src_shards) or len(dst_units) != len(dst_shards):
        raise LayoutsDoNotPair(TABLES_PER_RANK)
    _check_units(src_shards, src_units, page_size)
    _check_units(dst_shards, dst_units, page_size)
    counts = {(kind, getattr(u, kind).shape[0]) for u in (*src_units, *dst_units) for kind in UNIT_KINDS}
    if len(counts) != len(UNIT_KINDS):
        raise LayoutsDoNotPair(UNIT_COUNTS_DIFFER, counts=tuple(counts))
    if list(src_shards) == list(dst_shards):  # equal layouts: whole units, rank to rank
        return tuple(
            RankRuns(r, r, plan_runs(src_units[r].rows, dst_units[r].rows)) for r in range(len(src_shards))
        )
    plan = []
    for dst in dst_shards:
        for src_rank in range(len(src_shards)):
            templates = _pair_templates(tuple(src_shards), dst, src_rank, page_size)
            runs = _shifted(templates, src_units[src_rank], dst_units[dst.rank])
            if runs.shape[0]:
                plan.append(RankRuns(src_rank, dst.rank, runs))
    return tuple(plan)


@dataclass(frozen=True)
class PairPlanner:
    """What every plan of one (source rank, destination rank) pair reads, worked out once per
    channel: both ranks' unit sizes and the pair's unit templates (`unit_templates`; None between
    equal layouts). `runs` is then a pass over the envelope's two unit tables alone: the layouts
    are neither compared nor hashed again per request."""

    src_shard: RankShard
    dst_shard: RankShard
    src_unit_bytes: tuple[int, ...]  # per UNIT_KINDS
    dst_unit_bytes: tuple[int, ...]
    templates: tuple[np.ndarray | None, ...] | None  # per UNIT_KINDS: the pair's template, if any

    @classmethod
    def of(
        cls,
        src_shards: Sequence[RankShard],
        dst_shards: Sequence[RankShard],
        *,
        src_rank: int,
        dst_rank: int,
        page_size: int,
    ) -> PairPlanner:
        """The planner of the pair, after checking that the layouts pair and the ranks are theirs."""
        _check_layouts(src_shards, dst_shards)
        if not (0 <= src_rank < len(src_shards) and 0 <= dst_rank < len(dst_shards)):
            raise ValueError(
                f"no rank pair ({src_rank}, {dst_rank}) between TP {len(src_shards)} and {len(dst_shards)}"
            )
        src, dst = src_shards[src_rank], dst_shards[dst_rank]
        templates = None
        if list(src_shards) != list(dst_shards):
            templates = _pair_templates(tuple(src_shards), dst, src_rank, page_size)
        return cls(
            src_shard=src,
            dst_shard=dst,
            src_unit_bytes=_unit_sizes(src, page_size),
            dst_unit_bytes=_unit_sizes(dst, page_size),
            templates=templates,
        )

    def runs(self, src_units: EnvelopeUnits, dst_units: EnvelopeUnits) -> np.ndarray:
        """The pair's runs of one envelope (`plan_pair`); ValueError when the tables do not pair."""
        _check_sizes(self.src_shard, src_units, self.src_unit_bytes)
        _check_sizes(self.dst_shard, dst_units, self.dst_unit_bytes)
        for kind in UNIT_KINDS:
            src_count, dst_count = getattr(src_units, kind).shape[0], getattr(dst_units, kind).shape[0]
            if src_count != dst_count:
                raise ValueError(
                    f"the ranks' envelopes do not pair: {src_count} {kind}s at the source, {dst_count} here"
                )
        if self.templates is None:
            if self.src_shard.rank != self.dst_shard.rank:
                return np.zeros((0, 3), dtype=np.int64)
            return plan_runs(src_units.rows, dst_units.rows)
        return _shifted(self.templates, src_units, dst_units)


def plan_pair(
    src_shards: Sequence[RankShard],
    src_units: EnvelopeUnits,
    dst_shards: Sequence[RankShard],
    dst_units: EnvelopeUnits,
    *,
    src_rank: int,
    dst_rank: int,
    page_size: int,
) -> np.ndarray:
    """The runs source rank `src_rank` sends destination rank `dst_rank`: that pair's entry of
    `plan_reshard`, from the two ranks' unit tables alone (what one channel knows). (0, 3) when the
    pair moves nothing of this envelope. Raises ValueError when the layouts or the tables do not pair.
    A channel keeps the `PairPlanner` instead, and asks it for every envelope.
    """
    ranks = {"src_rank": src_rank, "dst_rank": dst_rank}
    return PairPlanner.of(src_shards, dst_shards, **ranks, page_size=page_size).runs(src_units, dst_units)


def _pair_templates(
    src_shards: tuple[RankShard, ...], dst: RankShard, src_rank: int, page_size: int
) -> tuple[np.ndarray | None, ...]:
    """The templates (source rank `src_rank`, `dst`) moves, per UNIT_KINDS (None: nothing of a kind)."""
    templates = unit_templates(src_shards, dst, page_size)
    return tuple(templates.get((src_rank, kind)) for kind in UNIT_KINDS)


def _shifted(
    templates: tuple[np.ndarray | None, ...], src_units: EnvelopeUnits, dst_units: EnvelopeUnits
) -> np.ndarray:
    """The templates (per UNIT_KINDS) shifted to every unit's start, merged.

    Each template is merged already (`unit_templates`), and a shift moves a unit's runs alike on
    both sides, so runs can only merge across two units: where none does, the shifted templates
    are the runs (no pass over them all). Written into one table, kind after kind."""
    kinds = []
    for kind, template in zip(UNIT_KINDS, templates, strict=True):
        src_at, dst_at = getattr(src_units, kind)[:, 0], getattr(dst_units, kind)[:, 0]
        if template is not None and src_at.size:
            kinds.append((template, src_at, dst_at))
    total = sum(template.shape[0] * src_at.size for template, src_at, _ in kinds)
    runs = np.empty((total, 3), dtype=np.int64)
    row, joins = 0, False
    for template, src_at, dst_at in kinds:
        units, k = src_at.size, template.shape[0]
        block = runs[row : row + units * k]
        for column, at in ((0, src_at), (1, dst_at)):  # column by column: numpy's inner loop runs k long
            np.add(template[None, :, column], at[:, None], out=block[:, column].reshape(units, k))
        block[:, 2].reshape(units, k)[:] = template[None, :, 2]
        row += units * k
    if total > 1:
        joins = _may_merge_across_units(runs, kinds)
    return merge_runs(runs[:, 0], runs[:, 1], runs[:, 2]) if joins else runs


def _may_merge_across_units(runs: np.ndarray, kinds: list) -> bool:
    """Whether the first run of some unit continues the last run of the unit before it on both sides."""
    firsts, row = [], 0
    for template, src_at, _ in kinds:
        firsts.append(row + np.arange(src_at.size, dtype=np.int64) * template.shape[0])
        row += src_at.size * template.shape[0]
    first = np.concatenate(firsts)[1:]  # (u - 1,) rows that start a unit, less the very first
    before, after = runs[first - 1], runs[first]
    ends = before[:, :2] + before[:, 2:3]
    return bool((ends == after[:, :2]).all(axis=1).any())
