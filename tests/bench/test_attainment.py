"""The highest rate at 90% SLO attainment, read off the measured rates."""

from __future__ import annotations

import math

import pytest

from distpool.bench.attainment import rate_at_attainment


def test_the_crossing_is_interpolated_between_the_rates_around_it():
    found = rate_at_attainment([(4.0, 0.5), (1.0, 1.0), (2.0, 0.95), (3.0, 0.85)])
    # 0.95 at 2/s, 0.85 at 3/s: 0.9 is halfway
    assert found.kind == "interpolated" and found.rate == pytest.approx(2.5)
    assert found.measured == ((1.0, 1.0), (2.0, 0.95), (3.0, 0.85), (4.0, 0.5))
    assert "2.5 req/s" in found.describe() and "4 req/s: 0.50" in found.describe()


def test_the_highest_rate_meeting_it_counts_when_attainment_is_not_monotone():
    found = rate_at_attainment([(1.0, 0.95), (2.0, 0.8), (3.0, 0.92), (4.0, 0.4)])
    assert found.kind == "interpolated" and found.rate == pytest.approx(3.0 + 0.02 / 0.52)


def test_met_at_every_rate_is_at_least_the_highest_and_exactly_at_target_is_that_rate():
    everywhere = rate_at_attainment([(1.0, 1.0), (2.0, 0.99), (math.inf, 0.2)])
    assert everywhere.kind == "measured" and everywhere.rate == 2.0  # inf is left out
    assert everywhere.describe().startswith("at least 2 req/s")
    exact = rate_at_attainment([(1.0, 1.0), (2.0, 0.9), (3.0, 0.1)])
    assert exact.kind == "measured" and exact.rate == 2.0


def test_met_at_no_rate_has_no_rate():
    found = rate_at_attainment([(1.0, 0.7), (2.0, 0.1)])
    assert found.rate is None and found.kind == "none"
    assert found.describe().startswith("below the lowest rate measured")


def test_only_infinite_rates_are_refused():
    with pytest.raises(ValueError, match="finite --request-rate"):
        rate_at_attainment([(math.inf, 1.0)])
