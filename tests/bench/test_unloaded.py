"""The SLOs chosen from unloaded figures: K x the medians, refused where there is nothing to take."""

from __future__ import annotations

import pytest

from distpool.bench.sessions import Session, Turn
from distpool.bench.unloaded import slos_from_figures, unloaded_sessions


def figures(ttft: float, tpot: float, failed: int = 0) -> dict:
    return {
        "completed": 5 - failed, "failed": failed, "errors": [],
        "median_ttft_ms": ttft, "median_tpot_ms": tpot,
    }  # fmt: skip


def test_the_slos_are_k_times_the_unloaded_medians():
    chosen = slos_from_figures(figures(400.0, 40.0), 3.0, 5)
    assert chosen.slos_ms == {"ttft": 1200.0, "tpot": 120.0}
    assert "TTFT 1200 ms (400)" in chosen.describe()


@pytest.mark.parametrize(
    "fig, message",
    [(figures(400.0, 40.0, failed=1), "failed"), (figures(400.0, 0.0), "no TPOT")],
)
def test_failed_or_one_token_requests_give_no_slos(fig, message):
    with pytest.raises(ValueError, match=message):
        slos_from_figures(fig, 3.0, 5)


def test_unloaded_requests_are_the_first_sessions_reversed_up_to_the_count():
    sessions = [
        Session(f"s{i}", tuple(Turn.of_ids([i, i + 1, i + 2], 4) for _ in range(2))) for i in range(5)
    ]
    chosen = unloaded_sessions(sessions, n=3)
    assert [len(s.turns) for s in chosen] == [2, 2]  # whole sessions until >= 3 requests
    assert chosen[1].turns[0].prompt_ids == (3, 2, 1)
    assert all(s.session_id.endswith("-unloaded") for s in chosen)
