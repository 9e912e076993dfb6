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

import torch
from transformers import AttentionInterface

from distpool.model_impl.hf.pool_views import KVViews
from distpool.model_impl.hf.transformers_internals import sdpa_attention_forward

PAGED_ATTENTION = "distpool_paged"


@dataclass(frozen=True)
class PagedBatch:
    """Where one forward's tokens live in the pool, for every attention layer of the model.

    Request b's token at `positions[b, t]` sits in page `page_table[b, p // page_size]`, row
    `p % page_size`; a query at position p sees every key at positions 0..p of its own request. What
    every layer needs of the page table is worked out once per forward (`over`), not per layer.
    """

    kv: KVViews  # full-attention layer -> its K and V pages, (num_pages, page_size, kv_heads, dim) each
    page_table: torch.Tensor  # (B, max_pages) int64 physical page ids, padded with a real page id
    write_pages: torch.Tensor  # (B, T) the page each of this forward's tokens is written to
    write_rows: torch.Tensor  # (B, T) its row in that page
    # (B, 1, T, max_pages * page_size) float: 0 where a query sees a key, -inf elsewhere (SDPA adds
    # it; a float mask is made once per forward where a boolean one is converted in every layer)
    visible: torch.Tensor

    @classmethod
    def over(
        cls,
        kv: KVViews,
        page_size: int,
        page_table: torch.Tensor,
        positions: torch.Tensor,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> PagedBatch:
        """`positions` (B, T) int64 ascending: this forward's tokens; `page_table` as above; `device`
        the pool's; `dtype` the queries'."""
        key_positions = torch.arange(page_table.shape[1] * page_size)
        hidden = key_positions[None, None, :] > positions[:, :, None]  # (B, T, keys)
        visible = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))
        return cls(
            kv=kv,
            page_table=page_table.to(device),
            write_pages=page_table.gather(1, positions // page_size).to(device),
            write_rows=(positions % page_size).to(device),
            visible=visible[:, None].to(device),
        )


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
    k_cache, v_cache = batch.kv[module.layer_idx]  # (num_pages, page_size, kv_heads, dim) each
    k_cache[batch.write_pages, batch.write_rows] = key.transpose(1, 2).to(k_cache.dtype)
    v_cache[batch.write_pages, batch.write_rows] = value.transpose(1, 2).to(v_cache.dtype)
    keys, values = (_gathered(cache, batch.page_table).to(query.dtype) for cache in (k_cache, v_cache))
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, keys, values, batch.visible, is_causal=False, **kwargs)


def _gathered(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """(B, kv_heads, max_pages * page_size, dim): each request's pages of `cache` in token order
    (`index_select`: one copy, a few times faster on a CPU than indexing with the table)."""
    b, num_pages = page_table.shape
    pages = cache.index_select(0, page_table.flatten())  # (B * max_pages, page_size, kv_heads, dim)
    return pages.view(b, num_pages * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


AttentionInterface.register(PAGED_ATTENTION, paged_attention)
