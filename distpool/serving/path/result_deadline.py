"""The driver's deadline on a request's result from its decode worker (`await_result`).

A result arrives through the decode worker's `next_finished` stream, however long decoding takes;
the deadline is on progress, not on time. Every `silence_s` without the result, the worker is asked
how far it got with the request (`DecodeWorker.progress`: prompt tokens prefilled there and tokens
generated; a TP group answers with its slowest rank's). It is waited on while that grows; after
STALLS_ALLOWED asks in a row that find no progress (or the request no longer held there: a rank
dropped it), the attempt fails as a timeout and is retried, and the caller gives the destination up.

    result ---------------------------------------------------------------> returned
    silence_s, no result --> ask: progress grew --> wait again
                                  no progress, STALLS_ALLOWED times --> Retry(TIMEOUT)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from distpool.serving.path.attempt_errors import Retry
from distpool.worker.messages import DecodeResult
from transfer.wire import FailureKind

STALLS_ALLOWED = 2  # asks in a row without progress; one more than a result on its way can cause
NOT_HELD = -1  # the progress of a request the worker does not hold


async def await_result(
    future: asyncio.Future,
    progress: Callable[[], Awaitable[dict[str, int]]],
    request_id: str,
    *,
    worker: str,
    silence_s: float,
) -> DecodeResult:
    """`future`'s result (the request's, from decode worker `worker`), awaited while `progress()`
    (that worker's `progress([request_id])`, through the driver's call) shows it advancing."""
    seen, stalls = NOT_HELD, 0
    while True:
        done, _ = await asyncio.wait({future}, timeout=silence_s)
        if done:
            return future.result()
        now = (await progress()).get(request_id, NOT_HELD)
        if future.done():  # handed out while the worker was asked
            return future.result()
        stalls = stalls + 1 if now <= seen or now == NOT_HELD else 0
        seen = max(seen, now)
        if stalls >= STALLS_ALLOWED:
            where = "no longer held there" if now == NOT_HELD else f"stuck at {now}"
            reason = f"{worker} made no progress on {request_id} for {stalls * silence_s:g} s ({where})"
            raise Retry(FailureKind.TIMEOUT, reason)
