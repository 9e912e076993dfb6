"""The one seam between transformers' attention modules and our pages: a registered attention function.

The runner loads its model with `attn_implementation=PAGED_ATTENTION`, and its cache's attention layers
pass the new tokens' K/V through untouched (`state_cache.py`). Every attention module then calls
`paged_attention` with only the new tokens' K/V; inside a pooled forward (`paged_forward`) it writes
them into the request's pages, gathers each request's keys and values from its page table, and hands
them to transformers' own SDPA function with a causal, length-aware mask. Outside one (the load-time
probe, `generate`) it is transformers' SDPA attention unchanged.

Gathering every page per step is what a CPU can do; a GPU path would read the page table inside the
kernel instead (FlashInfer's or vLLM's paged attention, FlashAttention's block table).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

if TYPE_CHECKING:
    from distpool.memory.pool import Pool

PAGED_ATTENTION = "distpool_paged"


@dataclass(frozen=True)
class PagedBatch:
    """Where one forward's tokens live in the pool, for every attention layer of the model.

    Request b's token at `positions[b, t]` sits in page `page_table[b, p // page_size]`, row
    `p % page_size`; a query at position p sees every key at positions 0..p of its own request.
    """

    pool: Pool
    page_table: torch.Tensor  # (B, max_pages) int64 physical page ids, padded with a real page id
    positions: torch.Tensor  # (B, T) int64: the positions of this forward's tokens, ascending

    @property
    def num_keys(self) -> int:
        """Key positions gathered per request: every page of the longest page table."""
        return self.page_table.shape[1] * self.pool.page_size


_batch: ContextVar[PagedBatch | None] = ContextVar("distpool_paged_batch", default=None)


@contextmanager
def paged_forward(batch: PagedBatch) -> Iterator[None]:
    """Run a forward whose attention layers read and write `batch`'s pages."""
    token = _batch.set(batch)
    try:
        yield
    finally:
        _batch.reset(token)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, heads, T, head_dim)
    key: torch.Tensor,  # (B, kv_heads, T, head_dim): this forward's tokens only
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    batch = _batch.get()
    if batch is None:  # not a pooled forward: transformers' own attention over what it was given
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("the paged attention function serves full attention only (no sliding window)")
    page_size = batch.pool.page_size
    k_cache, v_cache = batch.pool.kv_view(module.layer_idx)  # (num_pages, page_size, kv_heads, dim) each
    device = k_cache.device
    pages = batch.page_table.gather(1, batch.positions // page_size).to(device)  # (B, T)
    rows = (batch.positions % page_size).to(device)
    k_cache[pages, rows] = key.transpose(1, 2).to(k_cache.dtype)
    v_cache[pages, rows] = value.transpose(1, 2).to(v_cache.dtype)
    table = batch.page_table.to(device)
    # (B, max_pages, page_size, kv_heads, dim) -> (B, kv_heads, keys, dim)
    keys = k_cache[table].flatten(1, 2).transpose(1, 2).to(query.dtype)
    values = v_cache[table].flatten(1, 2).transpose(1, 2).to(query.dtype)
    key_positions = torch.arange(batch.num_keys, device=query.device)
    visible = key_positions[None, None, :] <= batch.positions.to(query.device)[:, :, None]  # (B, T, keys)
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, keys, values, visible[:, None], is_causal=False, **kwargs)


AttentionInterface.register(PAGED_ATTENTION, paged_attention)
