"""The pools of a tensor-parallel group: one rank's sizes beside the whole model's page and slot.

Each rank of the group has a pool of its own, sized by `size_pools` for the shapes the rank stores
(`distpool.model.shard`), within a per-rank budget. Every rank stores the same shapes, so one
rank's sizes are every rank's: its pages and slots hold every rank's part of the same tokens and
requests. Pure, like `size_pools`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distpool.memory.sizing.sizing import PoolArgs, PoolSizes, size_pools
from distpool.model.shard import RankShard, shard
from distpool.model.spec import ModelSpec


@dataclass(frozen=True)
class TpSizes:
    """One rank's pool sizes beside the model's whole page and slot (all ranks' parts, once)."""

    shard: RankShard  # rank 0's; every rank's shapes and sizes are the same
    rank: PoolSizes  # one rank's pool, within the per-rank budget
    page_bytes: int  # one full-attention page of the unsharded model (unpadded)
    swa_page_bytes: int
    slot_bytes: int

    @property
    def tp(self) -> int:
        return self.shard.tp

    def summary(self) -> dict[str, object]:
        """The rank pool's figures, with `page_bytes`, `swa_page_bytes` and `slot_bytes` the model's
        and the rank's beside them. At TP 1 the figures are `size_pools`' own."""
        return {
            **self.rank.summary(),
            "page_bytes": self.page_bytes,
            "swa_page_bytes": self.swa_page_bytes,
            "slot_bytes": self.slot_bytes,
            "tp": self.tp,
            "rank_page_bytes": self.rank.page_bytes,
            "rank_swa_page_bytes": self.rank.swa_page_bytes,
            "rank_slot_bytes": self.rank.slot_bytes,
            "replicated": list(self.shard.replicated),
        }


def size_tp_pools(spec: ModelSpec, args: PoolArgs, budget_bytes: int, tp: int) -> TpSizes:
    """Size one rank's pool of a `tp`-rank group with `budget_bytes` per rank.

    Raises ValueError for a TP size the model cannot shard (`distpool.model.shard.check_tp`) and for
    everything `size_pools` refuses."""
    rank0 = shard(spec, tp, 0)
    whole = spec.with_dtypes(kv_dtype=args.kv_dtype, conv_dtype=args.conv_dtype, ssm_dtype=args.ssm_dtype)
    return TpSizes(
        shard=rank0,
        rank=size_pools(rank0.spec, args, budget_bytes),
        page_bytes=args.page_size * whole.full_kv_bytes_per_token,
        swa_page_bytes=args.page_size * whole.swa_kv_bytes_per_token,
        slot_bytes=whole.slot_bytes,
    )
