"""The parity check's verdict per request: equal, a near tie (the oracle's top-2 logit margin at the
first differing step below 1e-4, reported with the margin) or a mismatch; the same rule for every
implementation, and the summary's counts."""

from __future__ import annotations

from distpool.serving.summary.parity import NEAR_TIE_MARGIN, Expected, Parity, compare
from distpool.serving.summary.report import summarize
from distpool.serving.summary.report_text import format_summary


def expected(tokens: list[int], margins: list[float] | None) -> Expected:
    return Expected(tokens=tokens, margin_at=(lambda step: None) if margins is None else margins.__getitem__)


def test_equal_tokens_pass_and_a_differing_token_is_judged_by_the_oracles_margin_there():
    margins = [0.5, 0.3, NEAR_TIE_MARGIN / 2, 0.2]
    assert compare("r", [1, 2, 3, 4], expected([1, 2, 3, 4], margins)) == ("equal", None)
    kind, note = compare("r", [1, 2, 9, 9], expected([1, 2, 3, 4], margins))
    assert kind == "near_tie" and note == (
        "parity: r: token 2 is 9, the oracle's 3: a near tie (the oracle's top-2 logit margin 5.00e-05)"
    )
    kind, note = compare("r", [1, 7, 3, 4], expected([1, 2, 3, 4], margins))
    assert (
        kind == "mismatch"
        and note == "parity: r: token 1 is 7, the oracle's 2 (its top-2 logit margin 3.00e-01)"
    )
    # after the first difference the sequences continue from different tokens: only that step counts
    assert compare("r", [1, 7, 9, 9], expected([1, 2, 3, 4], [0.5, 0.3, 0.0, 0.0]))[0] == "mismatch"


def test_an_oracle_without_logits_calls_every_difference_a_mismatch():
    assert compare("r", [5, 6], expected([5, 7], None)) == (
        "mismatch",
        "parity: r: token 1 is 6, the oracle's 7",
    )
    assert compare("r", [5], expected([5, 7], [1.0, 1.0]))[0] == "mismatch"  # a short output


def test_near_ties_are_counted_apart_and_their_margins_reach_the_errors():
    note = "parity: r: token 2 is 9, the oracle's 3: a near tie (the oracle's top-2 logit margin 5.00e-05)"
    report = summarize(
        [], retried=0, worker_stats=[], parity=Parity(checked=4, near_ties=1, notes=(note,)), wall_s=1.0
    )
    assert (report["parity_checked"], report["parity_mismatches"], report["parity_near_ties"]) == (4, 0, 1)
    assert report["errors"] == [note]
    assert "4 / 0 (1 near ties)" in format_summary(report)
