"""One rank of the tensor-parallel reference model: what it computes of each layer, and its all-reduce.

Every rank draws the full seeded weights and keeps its slice, so TP 1 and TP N are one model:

    attention  q, k, v: column-parallel by query heads / KV heads   o: row-parallel, then all-reduce
    Mamba2     in_proj: column-parallel [z | x B C | dt] by heads and groups; conv, dt, A, D by
               channel / head                                       out_proj: row-parallel, then all-reduce
    MLP        up: column-parallel by channels                      down: row-parallel, then all-reduce
    embedding, final norm, lm_head: replicated (every rank computes the whole logits)

Which KV heads, conv channels and SSM heads a rank holds comes from its `RankShard` pieces (part 1's
rules, replication included): the rank computes exactly what its pool stores. Query heads and MLP
channels, which no cache holds, split contiguously as the rules assume (rank r: the r-th block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distpool.model.shard import RankShard, TensorShard, shard
from distpool.model.spec import ModelSpec
from distpool.model_impl.errors import TpGroupMismatch, TpSplitUneven


@dataclass(frozen=True)
class TPRank:
    """Rank `shard.rank` of a `shard.tp`-rank group, summing partial outputs over `group`.

    `group` is a `torch.distributed` process group of exactly the TP group's ranks, in rank order
    (Gloo for CPU tensors, NCCL for CUDA ones), made by whoever starts the ranks; None at TP 1.
    Its timeout bounds every all-reduce. Every rank must run the same calls with the same inputs
    (prefill jobs, decode batches): each layer's all-reduce pairs up across ranks by order."""

    shard: RankShard
    group: dist.ProcessGroup | None

    @classmethod
    def of(cls, spec: ModelSpec, *, tp: int, rank: int, group: dist.ProcessGroup | None) -> TPRank:
        """Rank `rank` of `tp` over `group`; TpUnshardable (the shard rules') for a TP size the spec
        cannot shard, TpGroupMismatch for a group that is not this TP group."""
        rank_shard = shard(spec, tp, rank)
        if tp == 1:
            if group is not None and group.size() != 1:
                raise TpGroupMismatch(tp, rank, group.size(), group.rank())
            return cls(shard=rank_shard, group=None)
        if group is None:
            raise TpGroupMismatch(tp, rank, None, None)
        if (group.size(), group.rank()) != (tp, rank):
            raise TpGroupMismatch(tp, rank, group.size(), group.rank())
        return cls(shard=rank_shard, group=group)

    @property
    def tp(self) -> int:
        return self.shard.tp

    @property
    def rank(self) -> int:
        return self.shard.rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the group's ranks, in place (x itself at TP 1: no copy, no call)."""
        if self.group is None:
            return x
        self.group.allreduce([x]).wait()
        return x

    def block(self, count: int, unit: str) -> torch.Tensor:
        """The rank's contiguous block of `count` `unit`s that no cache holds (query heads, MLP
        channels): ids (count / tp,). TpSplitUneven when `count` does not split."""
        if count % self.tp:
            raise TpSplitUneven(self.tp, count, unit)
        per_rank = count // self.tp
        return torch.arange(self.rank * per_rank, (self.rank + 1) * per_rank)

    def held(self, tensor: str) -> torch.Tensor:
        """Ids along the shard axis of cached tensor `tensor` that the rank holds, in its own order
        (what its pool stores there): KV heads of "k", conv channels of a conv state, heads of "ssm"."""
        return held_ids(self.shard.tensor(tensor))


def held_ids(tensor: TensorShard) -> torch.Tensor:
    """Ids along `tensor`'s shard axis that its rank holds, in the rank's order: its pieces laid end
    to end (the pool's row of that rank is the unsharded row at these ids)."""
    return torch.cat([torch.arange(start, stop) for start, stop in tensor.pieces])


def columns(units: torch.Tensor, width: int) -> torch.Tensor:
    """The columns of units `units` (ids) in a matrix whose unit u spans [u * width, (u + 1) * width)."""
    return (units[:, None] * width + torch.arange(width)).flatten()
