"""SLOs chosen from the same run's unloaded figures: before the rated runs, the first deployment serves
a few requests one at a time (nothing else in flight), and each SLO is K times that unloaded median
(TTFT and TPOT). The first deployment's figures set the SLOs of every deployment: a comparison needs
one target for all, and it is known before any rated run starts."""

from __future__ import annotations

from dataclasses import dataclass, replace

from distpool.bench.metrics import run_figures
from distpool.bench.runner import Target, reversed_session, run_at_rate
from distpool.bench.sessions import Session

UNLOADED_REQUESTS = 5  # requests served one at a time before the rated runs


@dataclass(frozen=True)
class UnloadedSlos:
    """`slos_ms`: {"ttft": K x median TTFT, "tpot": K x median TPOT}, from `requests` requests."""

    k: float
    requests: int
    median_ttft_ms: float
    median_tpot_ms: float

    @property
    def slos_ms(self) -> dict[str, float]:
        return {"ttft": self.k * self.median_ttft_ms, "tpot": self.k * self.median_tpot_ms}

    def describe(self) -> str:
        return (
            f"SLOs {self.k:g} x the unloaded medians of {self.requests} requests one at a time: TTFT "
            f"{self.slos_ms['ttft']:.0f} ms ({self.median_ttft_ms:.0f}), TPOT {self.slos_ms['tpot']:.1f} "
            f"ms ({self.median_tpot_ms:.1f})"
        )


def slos_from_figures(figures: dict, k: float, requests: int) -> UnloadedSlos:
    """The rule, applied to an unloaded run's figures (`run_figures`' keys)."""
    if not k > 0:
        raise ValueError(f"K must be > 0; got {k}")
    if figures["failed"] or not figures["completed"]:
        raise ValueError(
            f"{figures['failed']} of the unloaded requests failed ({figures['errors']}); no SLOs to "
            "take from them. Fix: check the server, or give --goodput"
        )
    ttft, tpot = figures["median_ttft_ms"], figures["median_tpot_ms"]
    if not (ttft > 0 and tpot > 0):
        raise ValueError(
            "the unloaded requests have no TPOT (one output token each): give --output-len of 2 or "
            "more, or --goodput"
        )
    return UnloadedSlos(k=k, requests=requests, median_ttft_ms=ttft, median_tpot_ms=tpot)


def unloaded_sessions(sessions: list[Session], n: int = UNLOADED_REQUESTS) -> list[Session]:
    """The workload's first sessions, every turn's prompt reversed (the same lengths, nothing a prefix
    cache would keep for the rated runs), until they hold at least `n` requests."""
    chosen: list[Session] = []
    for session in sessions:
        if sum(len(s.turns) for s in chosen) >= n:
            break
        chosen.append(reversed_session(session, f"{session.session_id}-unloaded"))
    return chosen


def measure_unloaded_slos(target: Target, sessions: list[Session], k: float) -> UnloadedSlos:
    """Serves `unloaded_sessions` one request at a time on `target` and applies the rule."""
    chosen = unloaded_sessions(sessions)
    run = run_at_rate(replace(target, max_concurrency=1), chosen, [0.0] * len(chosen))
    figures = run_figures(run.results, run.duration_s, [50.0], {})
    return slos_from_figures(figures, k, len(run.results))
