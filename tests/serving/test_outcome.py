"""A successful attempt's outcome, filled in from the typed results prefill and decode hand back."""

from __future__ import annotations

import pickle

import pytest

from distpool.serving.outcome import Outcome
from distpool.worker.messages import (
    DecodeFailed,
    DecodeFinished,
    PrefillBusy,
    PrefillCause,
    PrefillFailed,
    PrefillItem,
    PrefillSent,
)
from distpool.worker.stats import PoolHeld
from tests.factories import make_decode_stats
from transfer import FailureKind

SENT = PrefillSent(transfer_bytes=4096, transfer_s=0.25, source_runs=2, computed_tokens=12)
FINISHED = DecodeFinished(
    tokens=[5, 6, 7], decode_s=0.5, admit_s=0.125, destination_runs=3, prefix_hit_tokens=8, verified=True
)


def test_a_successful_attempt_reads_both_workers_results():
    out = Outcome(request_id="r")
    # submitted at 10, the attempt began at 11, prefill was asked at 11.5, prefill answered at 12.
    out.succeeded(20, SENT, FINISHED, ("prefill-0", "decode-1"), (10.0, 11.0, 11.5, 12.0))
    assert (out.queue_s, out.reserve_s, out.transfer_s, out.first_token_s) == (1.0, 0.5, 0.25, 0.125)
    assert out.prefill_s == 0.25  # the prefill call's 0.5 s less the transfer's 0.25 s
    assert out.ttft_s == 2.125
    assert (out.transfer_bytes, out.source_runs, out.destination_runs) == (4096, 2, 3)
    assert (out.prompt_tokens, out.prefill_tokens_computed, out.decode_prefix_hit_tokens) == (20, 12, 8)
    assert (out.tokens, out.decode_s, out.verified, out.error) == ([5, 6, 7], 0.5, True, None)
    assert out.pair == ("prefill-0", "decode-1")


@pytest.mark.parametrize(
    "message",
    [
        PrefillItem(request_id="r", prompt=[1, 2, 3], decode_worker="decode-0"),
        SENT,
        PrefillBusy(reason="prefill-0 has no room", cause=PrefillCause.NO_ROOM),
        PrefillFailed(
            kind=FailureKind.ABORTED, reason="injected fault", retry=True, cause=PrefillCause.TRANSFER
        ),
        FINISHED,
        DecodeFailed(kind=FailureKind.CORRUPT, reason="corrupt envelope: received page 3", retry=False),
        make_decode_stats(steps=7),
        PoolHeld(pages_used=0, slots_used=1),
    ],
    ids=lambda message: type(message).__name__,
)
def test_every_message_crosses_a_process_boundary_unchanged(message):
    """Ray pickles what a call takes and returns: each message comes back equal and of its type."""
    back = pickle.loads(pickle.dumps(message))
    assert type(back) is type(message) and back == message
    if hasattr(message, "kind"):  # a failure's kind comes back as the enum member itself
        assert back.kind is message.kind
