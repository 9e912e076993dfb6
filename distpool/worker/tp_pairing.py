"""Which ranks of a prefill group and a decode group hold a channel, and what each rank is called.

A worker is a TP group of ranks (one process each). Every destination rank (decode) opens one
channel to each source rank (prefill) its shard needs (`transfer.plans.reshard.source_ranks`); with equal
TP sizes that is rank r to rank r. A request's envelope moves over all of a pair's channels at once.

    rank_name("decode-0", 1, tp=2) -> "decode-0.1"    (at TP 1 a rank is named as its group)

Pure: the deployment (which opens the channels) and the workers (which send and expect on them)
derive the same pairing from the same `WorkerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from distpool.model.shard import RankShard, shard
from distpool.model.spec import ModelSpec
from transfer.plans import source_ranks


def rank_name(group: str, rank: int, tp: int) -> str:
    """The name rank `rank` of worker group `group` goes by (its channels' peer name)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} of TP {tp}: ranks are 0 to {tp - 1}")
    return group if tp == 1 else f"{group}.{rank}"


@dataclass(frozen=True)
class TpPairing:
    """The channels between one prefill group (`prefill_tp` ranks) and one decode group
    (`decode_tp` ranks) of `spec`, as (source rank, destination rank) pairs."""

    spec: ModelSpec
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        self.shards("prefill"), self.shards("decode")  # check_tp: ValueError for a size it cannot shard

    def tp_of(self, role: str) -> int:
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def shards(self, role: str) -> tuple[RankShard, ...]:
        tp = self.tp_of(role)
        return tuple(shard(self.spec, tp, rank) for rank in range(tp))

    @cached_property
    def channels(self) -> tuple[tuple[int, int], ...]:
        """Every (source rank, destination rank) that moves bytes, destination ranks in order."""
        src, dst = self.shards("prefill"), self.shards("decode")
        return tuple((s, d) for d in range(self.decode_tp) for s in source_ranks(src, dst, d))

    def peers_of(self, role: str, rank: int) -> tuple[int, ...]:
        """The ranks of the other group that rank `rank` of `role` holds a channel with."""
        if role == "prefill":
            return tuple(d for s, d in self.channels if s == rank)
        return tuple(s for s, d in self.channels if d == rank)

    def peer_names(self, role: str, rank: int, peer_group: str) -> list[str]:
        """The names of those ranks, in group `peer_group`."""
        peer_tp = self.tp_of("decode" if role == "prefill" else "prefill")
        return [rank_name(peer_group, r, peer_tp) for r in self.peers_of(role, rank)]
