"""The driver's attempts in flight (`Attempts`): the one owner of each request's current attempt.

An attempt is opened on the decode worker that will hand its result out (`open`), and closed when it
ends, however it ends; in between, that worker's result stream fills it (`deliver`), a lost worker
fails it (`fail_on`), and the path that opened it awaits it (`result`). The calls an attempt makes
to workers go through here too (`call`, `quiet`, `in_background`).

A request that found no room (`Busy`) waits for room to free rather than polling: `room` is an event
set the next time room may have freed on some worker, that is when an attempt that held room ends
(both sides freed what it held), a decode worker hands out finished requests (their pages are free),
a prefill worker sends or fails an envelope (its source is free), or a lost worker comes back. An
attempt that was refused (`Busy`, or `refused` set) frees no room: it only gives back what it took
while trying, and counting that would have two refused requests wake each other in turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from distpool.serving.deploy import Recovery, WorkerLost
from distpool.serving.path.attempt_errors import NOT_HELD, Busy, NoProgress, Retry
from distpool.worker.messages import DecodeResult
from transfer.wire import FailureKind

T = TypeVar("T")

# The driver's deadline on a request's result from its decode worker (`await_result`).
#
# A result arrives through the decode worker's `next_finished` stream, however long decoding takes;
# the deadline is on progress, not on time. Every `silence_s` without the result, the worker is asked
# how far it got with the request (`DecodeWorker.progress`: prompt tokens prefilled there and tokens
# generated; a TP group answers with its slowest rank's). It is waited on while that grows; after
# STALLS_ALLOWED asks in a row that find no progress (or the request no longer held there: a rank
# dropped it), the attempt fails as a timeout and is retried, and the caller gives the destination up.
#
#     result ---------------------------------------------------------------> returned
#     silence_s, no result --> ask: progress grew --> wait again
#                                   no progress, STALLS_ALLOWED times --> NoProgress

STALLS_ALLOWED = 2  # asks in a row without progress; one more than a result on its way can cause


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
            raise NoProgress(worker, request_id, stalls * silence_s, now)


class Attempt:
    """Request `request_id`'s attempt, waiting for its result from decode worker `decode_name`."""

    def __init__(self, request_id: str, decode_name: str) -> None:
        self.request_id, self.decode_name = request_id, decode_name
        self.result: asyncio.Future[DecodeResult] = asyncio.get_running_loop().create_future()
        self.refused = False  # refused where it was asked: it held nothing, and its end frees no room


class Attempts:
    """The attempts of one `Server`, by request id (one at a time per request), and the calls they
    make: through `recovery`, a worker unanswered for `silence_s` is pinged and, lost, retried."""

    def __init__(self, recovery: Recovery, *, silence_s: float) -> None:
        self.recovery, self.silence_s = recovery, silence_s
        self.by_request: dict[str, Attempt] = {}
        self.background: list[asyncio.Task] = []  # cancelled when the server stops
        self._room = asyncio.Event()  # replaced each time it is set: see `room`

    def start(self) -> None:
        """Before serving on a (new) event loop: nothing runs beside, and `room` is fresh."""
        self.background = []
        self._room = asyncio.Event()

    @contextmanager
    def open(self, request_id: str, decode_name: str) -> Iterator[Attempt]:
        """`request_id`'s attempt on `decode_name`, for the `with` block; closed as it ends (what it
        held is freed by then: unless it was refused, room may have freed)."""
        attempt = self.by_request[request_id] = Attempt(request_id, decode_name)
        try:
            yield attempt
        except Busy:
            attempt.refused = True
            raise
        finally:
            del self.by_request[request_id]
            if not attempt.refused:
                self.room_freed()
            if attempt.result.done() and not attempt.result.cancelled():
                attempt.result.exception()  # a result that failed while nobody awaited it: seen, not lost

    def waits_on(self, decode_name: str, request_id: str) -> bool:
        """Whether `request_id` has an attempt waiting for its result from `decode_name`."""
        attempt = self.by_request.get(request_id)
        return attempt is not None and attempt.decode_name == decode_name

    def deliver(self, decode_name: str, finished: dict[str, DecodeResult]) -> None:
        """`decode_name` handed out `finished`: each fills its attempt there (if still open: else
        news of an attempt already given up). Their pages are free: room may have freed."""
        for rid, result in finished.items():
            attempt = self.by_request.get(rid)
            if attempt is not None and attempt.decode_name == decode_name and not attempt.result.done():
                attempt.result.set_result(result)
        if finished:
            self.room_freed()

    def fail_on(self, lost: str) -> None:
        """Worker `lost` was lost: the attempts waiting on it fail (and are retried)."""
        for attempt in self.by_request.values():
            if attempt.decode_name == lost and not attempt.result.done():
                attempt.result.set_exception(Retry(FailureKind.WORKER_LOST, f"{lost} died"))

    async def result(self, attempt: Attempt, handle) -> DecodeResult:
        """`attempt`'s result, awaited while its decode worker (`handle`) makes progress on it."""
        name, rid = attempt.decode_name, attempt.request_id
        return await await_result(
            attempt.result,
            lambda: self.call(name, handle.progress.remote([rid])),
            rid,
            worker=name,
            silence_s=self.silence_s,
        )

    # ---- room -----------------------------------------------------------------------------------
    @property
    def room(self) -> asyncio.Event:
        """An event set the next time room may free. Taken before trying, so that room freed between
        a refusal and the wait is not missed."""
        return self._room

    def room_freed(self) -> None:
        """Room may have freed: whoever waits for it tries again."""
        self._room.set()
        self._room = asyncio.Event()

    @staticmethod
    async def wait_for(room: asyncio.Event, timeout_s: float) -> None:
        """Until `room` is set or `timeout_s` passed (at most 0 s: no wait)."""
        try:
            await asyncio.wait_for(room.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            pass

    # ---- calls ----------------------------------------------------------------------------------
    async def call(self, name: str, awaitable: Awaitable) -> Any:
        """Await a call to worker `name`; Retry when the worker died or stopped answering."""
        try:
            return await self.recovery.call(name, awaitable, silence_s=self.silence_s)
        except WorkerLost as exc:
            raise Retry(FailureKind.WORKER_LOST, str(exc)) from exc

    async def quiet(self, ref: Awaitable[T]) -> T | None:
        """Await a call whose failure does not matter, as long as its worker answers in time: its
        answer, or None when it failed or stayed silent."""
        try:
            return await asyncio.wait_for(ref, self.silence_s)
        except Exception:  # the peer is gone, silent, or never held it: nothing left to free there
            return None

    def in_background(self, call: Coroutine[Any, Any, None]) -> None:
        """Run `call` beside the requests: cancelled when the server stops."""
        self.background.append(asyncio.get_running_loop().create_task(call))
