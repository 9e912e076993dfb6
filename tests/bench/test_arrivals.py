"""The arrival process: seeded gamma gaps with mean 1 / rate (shape 1: Poisson), all at once at inf."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distpool.bench.arrivals import arrival_offsets


def gaps(rate: float, burstiness: float, n: int = 20000, seed: int = 7) -> np.ndarray:
    offsets = arrival_offsets(n, rate, burstiness, seed)
    assert offsets[0] == 0.0 and len(offsets) == n
    return np.diff(offsets)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gaps_have_mean_one_over_rate_and_the_gamma_spread(burstiness):
    g = gaps(rate=5.0, burstiness=burstiness)
    assert (g >= 0).all()
    assert g.mean() == pytest.approx(1 / 5.0, rel=0.05)
    # a gamma of shape k has coefficient of variation 1 / sqrt(k): 1 for Poisson, less when even
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_a_seed_repeats_its_arrivals_and_another_does_not():
    assert arrival_offsets(50, 2.0, 1.0, seed=1) == arrival_offsets(50, 2.0, 1.0, seed=1)
    assert arrival_offsets(50, 2.0, 1.0, seed=1) != arrival_offsets(50, 2.0, 1.0, seed=2)


def test_inf_rate_sends_everything_at_once_and_inf_burstiness_evenly():
    assert arrival_offsets(4, math.inf, 1.0, seed=0) == [0.0] * 4
    assert arrival_offsets(4, 2.0, math.inf, seed=0) == pytest.approx([0.0, 0.5, 1.0, 1.5])


@pytest.mark.parametrize(("n", "rate", "burstiness"), [(0, 1.0, 1.0), (3, 0.0, 1.0), (3, 1.0, 0.0)])
def test_bad_arguments_are_refused(n, rate, burstiness):
    with pytest.raises(ValueError, match="must be"):
        arrival_offsets(n, rate, burstiness, seed=0)
