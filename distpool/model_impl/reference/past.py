"""What a reference-model chunk starts from: the K/V and the recurrent state of the tokens before it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from distpool.memory.pool import Pool
from distpool.model_impl.reference.layers import COMPUTE_DTYPE

Pair = tuple[torch.Tensor, torch.Tensor]


def _copy(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of pool memory in compute dtype: later writes into the pool leave it unchanged."""
    return x.to(device, COMPUTE_DTYPE, copy=True)


@dataclass(frozen=True)
class Past:
    """The cache of a request's first `num_tokens` tokens, in compute dtype on the model's device:
    copies, so writes into the pool afterwards do not change it. Past() is the empty cache."""

    num_tokens: int = 0
    kv: dict[int, Pair] = field(default_factory=dict)  # attention layer -> K, V (num_tokens, kv_heads, dim)
    states: dict[int, Pair] = field(default_factory=dict)  # Mamba layer -> (conv, ssm) after them

    @classmethod
    def read(
        cls,
        pool: Pool,
        request_id: str,
        num_tokens: int,
        checkpoint_slot: int,
        *,
        attention_layers: Iterable[int],
        mamba_layers: Iterable[int],
        device: torch.device,
    ) -> Past:
        """The rows of the request's first `num_tokens` tokens and the state in `checkpoint_slot` (a
        physical slot id), read from the pool."""
        pages = pool.page_ids(request_id)[: -(-num_tokens // pool.page_size)]
        kv = {}
        for layer in attention_layers:
            # (num_pages, page_size, kv_heads, head_dim) each -> (num_tokens, kv_heads, head_dim)
            k, v = (
                _copy(c[pages.to(c.device)].flatten(0, 1)[:num_tokens], device) for c in pool.kv_view(layer)
            )
            kv[layer] = (k, v)
        states = {}
        for layer in mamba_layers:
            conv, ssm = pool.state_view(layer)  # (num_slots, *state shape) each
            states[layer] = (_copy(conv[checkpoint_slot], device), _copy(ssm[checkpoint_slot], device))
        return cls(num_tokens=num_tokens, kv=kv, states=states)

    def then(self, num_tokens: int, kv: dict[int, Pair], states: dict[int, Pair]) -> Past:
        """This cache followed by `num_tokens` more tokens: their K/V `kv`, the state after them `states`."""
        joined = {}
        for layer, (k, v) in kv.items():
            if layer in self.kv:
                old_k, old_v = self.kv[layer]
                k, v = torch.cat([old_k, k]), torch.cat([old_v, v])
            joined[layer] = (k, v)
        return Past(num_tokens=self.num_tokens + num_tokens, kv=joined, states=states)
