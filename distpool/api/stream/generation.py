"""A request's choices generated side by side: one task per choice, their deltas merged as they come.

Whatever was ready when the consumer asked is merged into one batch (one delta per choice), so a
slow reader gets fewer, larger chunks and never waits on a timer. Leaving the iterator early (a
client gone) cancels every choice's task, which closes its engine iterator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing

from distpool.api.admission import WaitingRoom
from distpool.api.engine import Engine
from distpool.api.stream.choice import ChoiceJob, TextDelta, stream_choice


async def run_choices(
    engine: Engine,
    jobs: Sequence[ChoiceJob],
    decode: Callable[[list[int]], str] | None,
    room: WaitingRoom,
) -> AsyncIterator[list[TextDelta]]:
    """Batches of deltas until every choice has finished. The choices enter `room` when the first
    batch is asked for (ApiError 503 when it is full, before the engine sees them) and each leaves it
    at its first event or its end, whatever ends it. An engine error is raised here."""
    room.admit(len(jobs))
    queue: asyncio.Queue[TextDelta | Exception] = asyncio.Queue()
    waiting = {job.index for job in jobs}

    def leave(index: int) -> None:
        if index in waiting:
            waiting.discard(index)
            room.leave()

    async def pump(job: ChoiceJob) -> None:
        try:
            async with aclosing(stream_choice(engine, job, decode, lambda: leave(job.index))) as deltas:
                async for delta in deltas:
                    queue.put_nowait(delta)
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)
        finally:
            leave(job.index)

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    running = len(jobs)
    try:
        while running:
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            for item in ready:
                if isinstance(item, Exception):
                    raise item
            batch = merge(ready)
            running -= sum(1 for delta in batch if delta.finish_reason is not None)
            yield batch
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for index in list(waiting):  # a task cancelled before it ever ran
            leave(index)


def merge(deltas: list[TextDelta]) -> list[TextDelta]:
    """Consecutive deltas of each choice as one, in the order choices first appear."""
    merged: dict[int, TextDelta] = {}
    for delta in deltas:
        before = merged.get(delta.index)
        merged[delta.index] = (
            delta
            if before is None
            else TextDelta(
                index=delta.index,
                text=before.text + delta.text,
                token_ids=before.token_ids + delta.token_ids,
                completion_tokens=delta.completion_tokens,
                finish_reason=delta.finish_reason,
                first=before.first or delta.first,
            )
        )
    return list(merged.values())
