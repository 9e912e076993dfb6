"""The summary when workers were lost: counts come from what the results said, unknowns stay unknown."""

from __future__ import annotations

import json

from distpool.serving.outcome import Outcome
from distpool.serving.parity import Parity
from distpool.serving.report import format_summary, summarize
from distpool.serving.run import exit_status


def completed(rid: str) -> Outcome:
    return Outcome(request_id=rid, tokens=[1, 2], verified=True, transfer_bytes=100, transfer_s=1e-6)


def alive(name: str, verified: int) -> dict:
    figures = {f"{band}_{what}": 0 for band in ("pages", "slots") for what in ("used", "peak")}
    return {"name": name, "state": "alive", "verified_envelopes": verified, **figures} | {
        "pages_capacity": 8,
        "slots_capacity": 2,
    }


def dead(name: str) -> dict:
    """What `run.worker_stats` lists for a worker that does not answer."""
    figures = {f"{band}_{what}": None for band in ("pages", "slots") for what in ("used", "peak", "capacity")}
    return {"name": name, "state": "dead", "error": "RayActorError: died", **figures}


def report_of(outcomes: list[Outcome], stats: list[dict], *, retried: int = 0, **lost) -> dict:
    """The summary of a synthetic-cache run whose workers listed `stats`."""
    return summarize(
        outcomes,
        retried=retried,
        worker_stats=stats,
        parity=Parity(),
        wall_s=1.0,
        model_impl="synthetic",
        **lost,  # workers_lost, workers_restarted
    )


def test_a_restarted_workers_verifications_are_counted_from_the_results():
    """Regression: verified envelopes were the workers' own counters summed, and a decode worker
    restarted by Ray had forgotten its first life's ("verified 176 / corrupt 0" of 200 completed,
    exit 1 instead of 3)."""
    outcomes = [completed(f"r{i}") for i in range(6)]
    stats = [alive("prefill-0", 0), alive("decode-0", 1), alive("decode-1", 3)]  # decode-0 restarted
    report = report_of(outcomes, stats, retried=2, workers_lost=1, workers_restarted=1)
    assert report["verified_envelopes"] == report["completed"] == 6
    assert (report["leaked_pages"], report["leaked_slots"], report["leaks_unchecked"]) == (0, 0, {})
    assert exit_status(report) == 3


def test_the_leaks_of_a_worker_that_cannot_be_read_are_unknown_not_zero():
    """Regression: a dead worker's figures read 0/0/0, so its leaks passed for none."""
    outcomes = [completed("a"), completed("b")]
    stats = [alive("prefill-0", 0), alive("decode-0", 2), dead("decode-1")]
    report = report_of(outcomes, stats, workers_lost=1)
    assert (report["leaked_pages"], report["leaked_slots"]) == (None, None)
    assert report["leaks_unchecked"] == {"decode-1": "dead"}
    text = format_summary(report)
    assert "unknown (not read: decode-1: dead)" in text
    assert "?/?/?" in next(line for line in text.splitlines() if line.startswith("decode-1"))
    assert json.loads(json.dumps(report))["leaked_pages"] is None  # null in --json
    assert exit_status(report) == 3  # everything completed; a worker died on the way


def test_a_leak_on_a_worker_that_was_read_fails_the_run_though_another_could_not_be():
    stats = [alive("decode-0", 1) | {"slots_used": 1}, dead("decode-1")]
    report = report_of([completed("a")], stats)
    assert report["leaked_slots"] is None  # the total is unknown, but decode-0 holds a slot
    assert exit_status(report) == 1
