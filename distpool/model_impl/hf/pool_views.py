"""A pool's tensors as the transformers runner reads them every forward, built once per pool.

A pool's buffer and band geometry are fixed when it is built (`memory/arena.py`), so the K/V views of
its attention layers and its slots' state segments stay valid for as long as the pool lives: what
moves between forwards is which pages and slots a request owns, read from the pool at each step.
Rebuilding them every forward (a strided view per tensor per layer) cost as much as a tiny model's
whole decode step in transformers' own loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distpool.memory.pool import Pool
from distpool.model.spec import ModelSpec
from distpool.model_impl.hf.state_cache import SlotStates, StateCopies

KVViews = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V (num_pages, page_size, heads, dim)


@dataclass(frozen=True)
class PoolViews:
    """Every full-attention layer's K/V views and every Mamba layer's slot segments of one pool."""

    pool: Pool
    kv: KVViews
    slots: SlotStates

    @classmethod
    def of(cls, pool: Pool, spec: ModelSpec, copies: StateCopies) -> PoolViews:
        kv = {layer: pool.kv_view(layer) for layer in spec.full_attention_layers}
        return cls(pool=pool, kv=kv, slots=SlotStates(pool, spec, copies))
