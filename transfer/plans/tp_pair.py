"""The two ranks one channel joins across tensor-parallel sizes, and the runs it moves of an envelope.

A channel between source rank s of TP A and destination rank d of TP B (A != B) moves exactly
`plan_reshard`'s runs for the pair (s, d): each side's own envelope rows, split into units
(`EnvelopeUnits`: the slot, the pages, the window pages), paired unit by unit, the pieces inside
a unit at the plan's offsets (`transfer.plans.reshard.plan_pair`, through the pair's
`PairPlanner`, worked out once per channel). Both ends compute the same runs from the same two
tables, which cross as they always did: the source's rows in the HEADER, the destination's in
READY (each less the pages the destination holds already). The rest is known to both ends from
the handshake: the unsharded model and page size (compared there), and each end's TP size and
rank, from which every rank's shard follows (`distpool.model.shard.shard`).

With equal TP sizes (or no TP layout at all) there is no `TpPair`: row i moves to row i
(`transfer.plans.plan.plan_runs`), exactly as between two one-rank pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from distpool.memory.sizing import TpEnd, ceil_div
from distpool.model.shard import RankShard, shard
from transfer.plans.plan import plan_runs
from transfer.plans.reshard import EnvelopeUnits, PairPlanner, source_ranks
from transfer.plans.tp_handshake import tp_of


@dataclass(frozen=True)
class TpPair:
    """Source rank `src_rank` of the layout `src_shards`, destination rank `dst_rank` of `dst_shards`."""

    src_shards: tuple[RankShard, ...]
    dst_shards: tuple[RankShard, ...]
    src_rank: int
    dst_rank: int
    page_size: int

    @classmethod
    def of(cls, end: TpEnd | None, peer_hello: dict[str, Any], *, sending: bool) -> TpPair | None:
        """The pair a channel joins, from this end's TP layout and the peer's hello (which the
        handshake checked: same unsharded model, a pair the plan uses); None for equal TP sizes."""
        peer = tp_of(peer_hello)
        if end is None or peer["size"] == end.shard.tp:
            return None
        model, page_size = end.shard.model, int(end.model["page_size"])
        ours = tuple(shard(model, end.shard.tp, r) for r in range(end.shard.tp))
        theirs = tuple(shard(model, peer["size"], r) for r in range(peer["size"]))
        if sending:
            return cls(ours, theirs, end.shard.rank, peer["rank"], page_size)
        return cls(theirs, ours, peer["rank"], end.shard.rank, page_size)

    @property
    def channels_per_rank(self) -> int:
        """The most channels one of the pair's two ranks moves over at once: the destination rank
        has one per source rank it hears from, the source rank one per destination rank it serves."""
        heard = [source_ranks(self.src_shards, self.dst_shards, d) for d in range(len(self.dst_shards))]
        return max(len(heard[self.dst_rank]), sum(self.src_rank in ranks for ranks in heard))

    def __str__(self) -> str:
        return (
            f"source rank {self.src_rank} of TP {len(self.src_shards)} -> destination rank "
            f"{self.dst_rank} of TP {len(self.dst_shards)}"
        )

    def _units(self, rank_shard: RankShard, moving: torch.Tensor | np.ndarray, num_tokens: int, held: int):
        """One side's moving rows as units: the slot (if the shard keeps one), the pages the
        request's tokens take less the `held` ones, then the window pages."""
        spec = rank_shard.spec
        pages = ceil_div(num_tokens, self.page_size) if spec.full_attention is not None else 0  # Footprint
        if not 0 <= held <= pages:
            raise ValueError(f"{held} held pages, but a request of {num_tokens} tokens takes {pages}")
        return EnvelopeUnits.from_ranges(moving, num_pages=pages - held, has_slot=spec.mamba is not None)

    def runs(
        self,
        src_moving: torch.Tensor | np.ndarray,
        dst_moving: torch.Tensor | np.ndarray,
        *,
        num_tokens: int,
        held: int,
    ) -> np.ndarray:
        """The (m, 3) runs this pair moves of a request of `num_tokens` tokens whose first `held`
        pages the destination holds already; each side's `moving` rows are its envelope's (the
        held pages left out). Raises ValueError when the tables do not pair under the layouts."""
        src_units = self._units(self.src_shards[self.src_rank], src_moving, num_tokens, held)
        dst_units = self._units(self.dst_shards[self.dst_rank], dst_moving, num_tokens, held)
        return self.planner.runs(src_units, dst_units)

    @cached_property
    def planner(self) -> PairPlanner:
        """The pair's unit sizes and templates, worked out at the first request (`plan_pair` per
        request compared and hashed both layouts again: most of a plan's time)."""
        return PairPlanner.of(
            self.src_shards,
            self.dst_shards,
            src_rank=self.src_rank,
            dst_rank=self.dst_rank,
            page_size=self.page_size,
        )


def channel_runs(
    pair: TpPair | None,
    src_moving: torch.Tensor | np.ndarray,
    dst_moving: torch.Tensor | np.ndarray,
    *,
    num_tokens: int,
    held: int,
) -> np.ndarray:
    """What one channel moves of an envelope: row i to row i (`plan_runs`) between equal layouts
    (`pair` None), else the pair's share of the reshard plan. Both ends call it with the same
    tables; ValueError when they do not pair."""
    if pair is None:
        return plan_runs(src_moving, dst_moving)
    return pair.runs(src_moving, dst_moving, num_tokens=num_tokens, held=held)
