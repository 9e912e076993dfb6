"""Prefill batches: requests for one prefill worker gathered into `prefill_and_send` calls."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import ray

from distpool.worker.messages import PrefillItem, PrefillResult

PREFILL_BATCH = 8
BATCHES_IN_FLIGHT = 2


@dataclass
class Batcher:
    """Collects prefill requests for one worker and runs them as `prefill_and_send` calls, up to
    BATCHES_IN_FLIGHT at once (one batch prefills while the previous one's envelopes move)."""

    handle: ray.actor.ActorHandle
    pending: list[tuple[PrefillItem, asyncio.Future]] = field(default_factory=list)
    drains: list[asyncio.Task] = field(default_factory=list)  # kept: a task nobody holds may be collected

    async def submit(self, item: PrefillItem) -> PrefillResult:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((item, future))
        self.drains = [task for task in self.drains if not task.done()]
        if len(self.drains) < BATCHES_IN_FLIGHT:
            self.drains.append(asyncio.get_running_loop().create_task(self._drain()))
        return await future

    def fail_pending(self, exc: Exception) -> None:
        """The worker was lost: requests not sent to it yet fail with `exc` and are never sent (its
        new life starts empty; it is given requests again once it rejoined)."""
        pending, self.pending = self.pending, []
        for _, future in pending:
            if not future.done():
                future.set_exception(exc)

    async def _drain(self) -> None:
        while self.pending:
            await asyncio.sleep(0)  # let requests that arrive together join the batch
            batch, self.pending = self.pending[:PREFILL_BATCH], self.pending[PREFILL_BATCH:]
            batch = [(item, future) for item, future in batch if not future.done()]  # else given up
            if not batch:
                continue
            try:
                out = await self.handle.prefill_and_send.remote([item for item, _ in batch])
                for item, future in batch:
                    if not future.done():  # else its request gave up waiting (a silent worker)
                        future.set_result(out[item.request_id])
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
