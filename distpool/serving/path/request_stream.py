"""One submitted request as its caller reads it (`RequestStream`): its tokens as they are made, then
its outcome.

Tokens come from the decode worker's streaming long-poll (`DecodeWorker.next_events`), each batch with
the index of its first token, so a batch seen twice, or a retried attempt that makes the same tokens
again on another worker (its seed fixes them), adds nothing: only tokens past those already handed out
go on. The outcome comes last, with the tokens the stream did not carry yet (a worker streams a
request's tokens only while it runs, so the token that ended it, an EOS or stop id, always comes with
the outcome).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from distpool.serving.outcome import Outcome


@dataclass(frozen=True)
class Delta:
    """New tokens of a request; the last delta carries its `outcome`."""

    tokens: list[int]
    outcome: Outcome | None = None


class RequestStream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.sent = 0  # tokens handed to the queue so far
        self.outcome: Outcome | None = None
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None  # when its first token reached the driver
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()

    def offer(self, start: int, tokens: list[int]) -> None:
        """Tokens `start`.. of the request, as a worker made them: those not handed out yet go on."""
        if self.outcome is not None or start > self.sent:  # ended; or a gap its outcome fills
            return
        if new := self._take(start, tokens):
            self._queue.put_nowait(Delta(new))

    def _take(self, start: int, tokens: list[int]) -> list[int]:
        new = list(tokens[self.sent - start :])
        if new and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.sent += len(new)
        return new

    def end(self, outcome: Outcome) -> None:
        """The request ended: its tokens not streamed yet go on with `outcome`, the last delta."""
        if self.outcome is not None:
            return
        rest = self._take(0, outcome.tokens) if outcome.tokens is not None else []
        self.outcome = outcome
        self._queue.put_nowait(Delta(rest, outcome))

    async def deltas(self) -> AsyncIterator[Delta]:
        """New tokens as they come; the last delta has the outcome."""
        while True:
            delta = await self._queue.get()
            yield delta
            if delta.outcome is not None:
                return
