"""`RequestStream`: what a submitted request's caller reads."""

from __future__ import annotations

import asyncio

from distpool.serving.outcome import Outcome
from distpool.serving.path.request_stream import RequestStream


def read(stream: RequestStream):
    async def main():
        return [delta async for delta in stream.deltas()]

    return asyncio.run(main())


def test_tokens_seen_twice_or_from_a_retried_attempt_go_out_once():
    stream = RequestStream("r")
    stream.offer(0, [5])
    stream.offer(0, [5, 6])  # the first seen again (a retry on another worker makes the same tokens)
    stream.offer(3, [9])  # a gap: dropped, its outcome fills it
    stream.end(Outcome("r", tokens=[5, 6, 7, 9]))
    stream.offer(4, [10])  # after the end: nothing
    deltas = read(stream)
    assert [d.tokens for d in deltas] == [[5], [6], [7, 9]]
    assert deltas[-1].outcome is not None and all(d.outcome is None for d in deltas[:-1])
    assert stream.first_token_at is not None


def test_a_failed_request_ends_with_its_outcome_and_no_tokens():
    stream = RequestStream("r")
    stream.offer(0, [1, 2])
    stream.end(Outcome("r", error="lost"))
    deltas = read(stream)
    assert [d.tokens for d in deltas] == [[1, 2], []] and deltas[-1].outcome.error == "lost"
