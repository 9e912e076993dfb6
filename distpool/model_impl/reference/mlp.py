"""The reference model's MLP layer (shared numerics and weights: layers.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distpool.model_impl.reference.layers import WeightFactory, take
from distpool.model_impl.reference.tensor_parallel import TPRank


class MlpLayer:
    """Nemotron-H MLP: down(relu(up(x)) ** 2). On a TP rank: its block of channels, all-reduced."""

    def __init__(
        self, weights: WeightFactory, *, hidden_size: int, intermediate_size: int, tp: TPRank
    ) -> None:
        channels = tp.block(intermediate_size, "MLP channels (intermediate_size)")
        self.tp = tp
        self.up_proj = take(
            weights.normal(hidden_size, intermediate_size, std=hidden_size**-0.5), 1, channels
        )
        down_proj = weights.normal(intermediate_size, hidden_size, std=intermediate_size**-0.5)
        self.down_proj = take(down_proj, 0, channels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.relu(x @ self.up_proj).square() @ self.down_proj)
