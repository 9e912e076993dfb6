"""What the layer kinds of the reference hybrid model share: the compute dtype, rounding to a cache's
dtype, the norm, seeded weights and a rank's slice of them. The kinds, one per file: GQA attention
(`attention.py`), Mamba2 (`mamba2.py`) and a relu^2 MLP (`mlp.py`); which layer is which:
`layer_stack.py`.

Every layer computes in float64 from float32-representable weights. Values a cache stores (K and V,
the conv inputs, the SSM state) are rounded to their cache dtype where they are produced, on the
cached and on the uncached path alike, so both paths see the same numbers and greedy tokens agree.
Layers take and return plain tensors; the model moves them in and out of pages and slots.

On a tensor-parallel rank (`TPRank`) a layer keeps its slice of the full weights (see
`tensor_parallel`): it reads and writes the rank's shard of each cache and returns its output summed
over the group, so the residual stream is the same on every rank and at every TP size.
"""

from __future__ import annotations

import torch

COMPUTE_DTYPE = torch.float64


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as it reads back after a round trip through a cache of `dtype` (still in x's dtype)."""
    return x.to(dtype).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | float, eps: float) -> torch.Tensor:
    """Every norm weight of the reference model is 1.0 (its initial value), so callers pass 1.0."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class WeightFactory:
    """Draws weights from one seeded generator, in a fixed order.

    Draws happen in float32 on the CPU so every device gets the same numbers; the results are
    handed out as float64 on the target device.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.device = device

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(COMPUTE_DTYPE).to(self.device)

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        return self._out(torch.randn(shape, generator=self.generator) * std)

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        return self._out(torch.rand(shape, generator=self.generator) * (high - low) + low)


def take(weight: torch.Tensor, dim: int, ids: torch.Tensor) -> torch.Tensor:
    """The rank's slice of a full weight: entries `ids` along `dim` (a contiguous copy)."""
    return weight.index_select(dim, ids.to(weight.device))
