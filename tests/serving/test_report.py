"""The summary when workers were lost: counts come from what the results said, unknowns stay unknown."""

from __future__ import annotations

import json

from distpool.serving.job.main import exit_status
from distpool.serving.outcome import Outcome
from distpool.serving.summary.parity import Parity
from distpool.serving.summary.report import summarize
from distpool.serving.summary.report_text import format_summary
from distpool.serving.summary.worker_reading import WorkerReading
from distpool.worker.stats import PoolHeld
from tests.factories import make_decode_stats


def completed(rid: str) -> Outcome:
    return Outcome(request_id=rid, tokens=[1, 2], verified=True, transfer_bytes=100, transfer_s=1e-6)


def alive(name: str, verified: int, **figures: int) -> WorkerReading:
    return WorkerReading(name=name, stats=make_decode_stats(name, verified_envelopes=verified, **figures))


def dead(name: str) -> WorkerReading:
    """What `run.worker_stats` lists for a worker that does not answer."""
    return WorkerReading(name=name, state="dead", error="RayActorError: died")


def report_of(outcomes: list[Outcome], stats: list[WorkerReading], *, retried: int = 0, **lost) -> dict:
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
    stats = [alive("decode-0", 1, slots_used=1), dead("decode-1")]
    report = report_of([completed("a")], stats)
    assert report["leaked_slots"] is None  # the total is unknown, but decode-0 holds a slot
    assert exit_status(report) == 1


def test_a_reading_keeps_the_larger_use_once_the_prefix_cache_is_dropped():
    """`drop_prefix_caches`: what a pool still holds after the drop counts where it is larger."""
    reading = WorkerReading(name="decode-0", stats=make_decode_stats(pages_used=3, slots_used=0))
    after = reading.after_drop(PoolHeld(pages_used=1, slots_used=2))
    assert (after.stats.pages_used, after.stats.slots_used) == (3, 2)
    entry = after.failed("TimeoutError: drop").to_json()  # one entry of the summary's `workers`
    assert (entry["name"], entry["state"], entry["role"], entry["slots_used"]) == (
        "decode-0",
        "alive",
        "decode",
        2,
    )
    assert entry["error"] == "TimeoutError: drop" and json.loads(json.dumps(entry)) == entry
    assert dead("decode-1").to_json()["pages_capacity"] is None  # unknown, not zero


def test_a_path_no_request_took_has_no_latency_rather_than_zero():
    """Regression: with every request transferred, the summary read `local 0.0 ms`."""
    report = report_of([completed("r0"), completed("r1")], [alive("decode-0", verified=2)])
    assert (
        report["ttft_ms_by_path"]["local"] == report["tpot_ms_by_path"]["local"] == {"p50": None, "p99": None}
    )
    assert report["ttft_ms_by_path"]["remote"]["p50"] is not None
    text = format_summary(report)
    assert [
        line for line in text.splitlines() if "remote / local" in line and line.rstrip().endswith("/ - ms")
    ]
    json.dumps(report)  # null in the JSON


def test_small_envelopes_move_at_a_rate_the_summary_shows():
    """Regression: 100 bytes per transfer read `transfer ... at 0.00 GB/s`."""
    slow = Outcome(request_id="r0", tokens=[1, 2], verified=True, transfer_bytes=2_000_000, transfer_s=1.0)
    text = format_summary(report_of([slow], [alive("decode-0", verified=1)]))
    assert [line for line in text.splitlines() if line.startswith("transfer ") and "at 2.00 MB/s" in line]


def test_the_summary_names_the_deployment_colocated_or_pd():
    local = Outcome(request_id="r0", tokens=[1, 2], verified=True, path="local")
    stats = [alive("decode-0", verified=1), alive("decode-1", verified=0)]
    colocated = report_of([local], stats, workers=(0, 2))
    assert (colocated["deployment"], colocated["prefill_workers"], colocated["decode_workers"]) == (
        "colocated",
        0,
        2,
    )
    text = format_summary(colocated)
    assert "distpool colocated run summary" in text and "colocated: 2 workers prefilling" in text
    pd = format_summary(report_of([completed("r0")], stats[:1], workers=(2, 1)))
    assert "distpool PD run summary" in pd and [line for line in pd.splitlines() if line.endswith(" 2P1D")]
