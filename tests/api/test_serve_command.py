"""`distpool serve`'s flags, refused before Ray starts, and its last line (no Ray here)."""

from __future__ import annotations

import socket

import pytest

from distpool.api.pd_engine import ttft_parts_ms
from distpool.api.serve_app import summary_line, ttft_parts_line
from distpool.cli import main
from distpool.serving.outcome import Outcome


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--requests", "5"], "--requests shapes `distpool run`'s batch workload"),
        (["--temperature", "0.5"], "Fix: drop --temperature"),
        (["--json", "out.json"], "Fix: drop --json"),
        (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
        (["--ingress-replicas", "0"], "--ingress-replicas must be >= 1"),
        (["--max-waiting-requests", "0"], "max_waiting_requests must be a whole number >= 1"),
        (["--port", "70000"], "--port must be 1-65535"),
    ],
)
def test_bad_serve_flags_are_refused_before_ray_starts(capsys, flags, words):
    assert main(["serve", *flags]) == 2
    assert words in capsys.readouterr().err


def test_a_port_in_use_is_refused_naming_it(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"--port {port}: cannot listen there" in capsys.readouterr().err


def test_the_summary_line_names_who_holds_leaked_memory_and_why_requests_failed():
    summary = {
        "served": 5, "cancelled": 2, "failed": 1, "retried": 3, "leaked_pages": 4, "leaked_slots": 1,
        "held_by": {"decode-0": (4, 1, "1 running")}, "errors": ["WorkerLost: decode-1 died"],
    }  # fmt: skip
    line = summary_line(summary)
    assert line.startswith("distpool: served 5, cancelled 2, failed 1 (retried 3); leaked 4 pages, 1 slots")
    assert "(decode-0: 4 pages, 1 slots by 1 running)" in line and line.endswith(
        "errors: WorkerLost: decode-1 died"
    )
    clean = summary_line({**summary, "failed": 0, "leaked_pages": 0, "leaked_slots": 0, "held_by": {}})
    assert clean.endswith("leaked 0 pages, 0 slots")
    unknown = summary_line({**summary, "failed": 0, "leaked_pages": None, "held_by": {}})
    assert "leaked unknown pages" in unknown


def test_the_ttft_parts_line_gives_each_part_s_median_over_served_requests():
    served = [
        Outcome("a", tokens=[1], queue_s=0.010, prefill_s=0.100),
        Outcome("b", tokens=[1], queue_s=0.030),
    ]
    parts = ttft_parts_ms([*served, Outcome("c", error="lost", queue_s=9.0)])
    assert parts == {
        "queue": 10.0,
        "reserve": 0.0,
        "prefill": 0.0,
        "transfer": 0.0,
        "first_token": 0.0,
        "requests": 2,
    }
    line = ttft_parts_line(parts)
    assert line == (
        "distpool: TTFT p50 parts (ms) over 2 served: "
        "queue 10, reserve 0, prefill 0, transfer 0, first token 0"
    )


def test_counts_come_from_the_outcomes_a_stop_string_s_cancellation_served():
    from distpool.api.pd_engine import STOPPED, served_counts

    def cancelled(why: str) -> Outcome:
        out = Outcome("x", error=why)
        out.cancelled = True
        return out

    outcomes = [Outcome("a", tokens=[1]), cancelled(STOPPED), cancelled("cancelled"), cancelled("drained")]
    outcomes.append(Outcome("e", error="lost"))
    assert served_counts(outcomes) == {"served": 2, "cancelled": 2, "failed": 1}
