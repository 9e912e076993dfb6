"""When each request (each conversation's first turn) is sent: a seeded arrival process at a rate."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_arrivals: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each of `num_arrivals` arrivals is sent, the first at 0.

    The gaps are gamma-distributed with shape `burstiness` and mean 1 / `rate` (shape 1: exponential
    gaps, a Poisson process; below 1 burstier, above 1 more even; `inf`: every gap exactly 1 / rate).
    `rate` inf sends everything at once. The same arguments give the same offsets."""
    if num_arrivals < 1:
        raise ValueError(f"num_arrivals must be >= 1; got {num_arrivals}")
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0 (inf: all at once); got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1: Poisson); got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_arrivals
    if math.isinf(burstiness):
        gaps = np.full(num_arrivals - 1, 1.0 / rate)
    else:
        # gamma(shape k, scale theta) has mean k * theta: theta = 1 / (rate * k) keeps the mean 1 / rate
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_arrivals - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
