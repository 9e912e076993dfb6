"""The reference model's attention layer (shared numerics and weights: layers.py)."""

from __future__ import annotations

import torch

from distpool.model_impl.reference.layers import WeightFactory, round_to, take
from distpool.model_impl.reference.tensor_parallel import TPRank, columns


class AttentionLayer:
    """Grouped-query attention without positional encoding (Nemotron-H attention is NoPE).

    On a TP rank: its block of query heads and the KV heads its pool stores (one replicated KV
    head when the ranks outnumber the KV heads), o_proj's matching rows, the output all-reduced."""

    def __init__(
        self,
        weights: WeightFactory,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: torch.dtype,
        tp: TPRank,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
        heads, kv_heads = tp.block(num_heads, "query heads"), tp.held("k")
        # the KV heads serving the rank's query heads are exactly the ones its pool holds
        if not torch.equal((heads // (num_heads // num_kv_heads)).unique(), kv_heads):
            raise ValueError(
                f"rank {tp.shard.rank}'s pool holds KV heads {kv_heads.tolist()}, not its query heads' ones"
            )
        self.num_heads = len(heads)
        self.num_kv_heads = len(kv_heads)
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        self.tp = tp
        q_columns, kv_columns = columns(heads, head_dim), columns(kv_heads, head_dim)
        # (in, out) so that a projection is `x @ w`
        q_proj = weights.normal(hidden_size, num_heads * head_dim, std=hidden_size**-0.5)
        k_proj = weights.normal(hidden_size, num_kv_heads * head_dim, std=hidden_size**-0.5)
        v_proj = weights.normal(hidden_size, num_kv_heads * head_dim, std=hidden_size**-0.5)
        o_proj = weights.normal(num_heads * head_dim, hidden_size, std=(num_heads * head_dim) ** -0.5)
        self.q_proj, self.o_proj = take(q_proj, 1, q_columns), take(o_proj, 0, q_columns)
        self.k_proj, self.v_proj = take(k_proj, 1, kv_columns), take(v_proj, 1, kv_columns)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., hidden) -> q (..., heads, head_dim); k, v (..., kv_heads, head_dim), rounded to the
        KV cache dtype."""
        lead = x.shape[:-1]
        q = (x @ self.q_proj).view(*lead, self.num_heads, self.head_dim)
        k = (x @ self.k_proj).view(*lead, self.num_kv_heads, self.head_dim)
        v = (x @ self.v_proj).view(*lead, self.num_kv_heads, self.head_dim)
        return q, round_to(k, self.kv_dtype), round_to(v, self.kv_dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """q (B, Tq, heads, d); k, v (B, S, kv_heads, d); valid (B, Tq, S) bool -> (B, Tq, hidden).

        Keys no query may see are zeroed first: gathered pages hold whatever bytes were there before
        (possibly NaN), and 0 * NaN would leak through the softmax weights.
        """
        seen = valid.any(dim=1)[:, :, None, None]  # (B, S, 1, 1)
        k = torch.where(seen, k, 0.0).repeat_interleave(self.num_heads // self.num_kv_heads, dim=2)
        v = torch.where(seen, v, 0.0).repeat_interleave(self.num_heads // self.num_kv_heads, dim=2)
        scores = torch.einsum("bqhd,bshd->bhqs", q, k) * self.head_dim**-0.5
        scores = scores.masked_fill(~valid[:, None], float("-inf"))
        out = torch.einsum("bhqs,bshd->bqhd", scores.softmax(dim=-1), v)
        return self.tp.all_reduce(out.reshape(*out.shape[:2], -1) @ self.o_proj)
