"""The driver's side of a disaggregated attempt (README, "How one request moves"): a destination
reserved on a decode worker (`serving.path.reservations`), batched prefill and the whole-envelope send on
a prefill worker (the transfer header carries the first token), and the result through that decode
worker's `next_finished` stream. The attempt's injected fault, if any, is planned on the workers it
strikes; after a failure the destination is given up and a broken channel rebuilt."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import ray

from distpool.serving.deploy import Deployment
from distpool.serving.outcome import Outcome
from distpool.serving.path.attempt_errors import Busy, GiveUp, Retry, decode_failure
from distpool.serving.path.attempts import Attempts
from distpool.serving.path.faults import CORRUPT_ONE_RANK, RECEIVER_CANCEL, FaultPlan
from distpool.serving.path.reservations import Reservations
from distpool.serving.routing import Router
from distpool.serving.workloads import Request
from distpool.worker.messages import (
    DecodeFailed,
    PrefillBusy,
    PrefillFailed,
    PrefillItem,
    PrefillResult,
)
from transfer.faults import CORRUPT_PAYLOAD, RECEIVER_FAULTS, SENDER_FAULTS
from transfer.wire import FailureKind

# Prefill batches: requests for one prefill worker gathered into `prefill_and_send` calls.

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


class RemotePath:
    """The disaggregated attempts of one `Server`: its prefill batchers and channel rebuilds. Each
    attempt is opened in `attempts`, which owns it and the calls it makes."""

    def __init__(
        self,
        deployment: Deployment,
        router: Router,
        reservations: Reservations,
        faults: FaultPlan,
        attempts: Attempts,
    ) -> None:
        self.dep, self.router, self.reservations = deployment, router, reservations
        self.faults, self.attempts = faults, attempts
        self.batchers = {name: Batcher(h) for name, h in deployment.prefill.items()}
        self.rebuild_locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def attempt(self, req: Request, out: Outcome, submitted: float, avoid: set[str]) -> None:
        """Serve `req` through a prefill worker and a decode worker, filling `out`; Busy, Retry or
        GiveUp when it did not (both sides freed), and a decode worker that failed it in `avoid`."""
        rid = req.request_id
        prefill_name = self.router.pick_prefill()
        self.router.begin(prefill_name)  # counted at once, so that concurrent requests spread out
        fault = self.faults.draw()
        try:
            planned_on = await self._plan_fault(rid, fault, prefill_name)
        except BaseException:
            self.router.end(prefill_name)
            raise
        asked = time.monotonic()
        reserving: asyncio.Task | None = None
        try:
            decode_name = self.reservations.overlap_candidate(req, prefill_name, avoid)
            if decode_name is not None:  # reserved while prefill computes
                reserving = asyncio.ensure_future(
                    self.reservations.reserve_on(decode_name, req, prefill_name)
                )
            else:
                decode_name = await self.reservations.reserve_first(req, prefill_name, avoid)
        except BaseException:
            self.router.end(prefill_name)
            await self._forget_fault(rid, planned_on)
            raise
        item = PrefillItem(request_id=rid, prompt=req.prompt, decode_worker=decode_name, params=req.params)
        sending: asyncio.Future | None = None
        try:
            with self.attempts.open(rid, decode_name) as attempt:
                try:
                    if reserving is not None:
                        sending = asyncio.ensure_future(self._prefill(prefill_name, item))
                        await self.reservations.settle(reserving, sending, decode_name, avoid)
                    prefill_asked = asked if sending is not None else time.monotonic()
                    if fault == RECEIVER_CANCEL:  # decode gives it up while prefill is on its way
                        cancel = self.dep.decode[decode_name].cancel.remote(rid, notify=True)
                        self.attempts.in_background(self.attempts.quiet(cancel))
                    if sending is None:
                        sending = asyncio.ensure_future(self._prefill(prefill_name, item))
                    sent = await sending
                    sent_at = time.monotonic()
                    if isinstance(sent, PrefillBusy):  # the prefill pool is full: give the destination back
                        raise Busy(sent.reason)
                    if isinstance(sent, PrefillFailed):
                        avoid.add(decode_name)
                        raise (Retry if sent.retry else GiveUp)(sent.kind, sent.reason)
                    result = await self.attempts.result(attempt, self.dep.decode[decode_name])
                    if isinstance(result, DecodeFailed):  # retried where decode says another may succeed
                        raise decode_failure(result)
                    times = (submitted, asked, prefill_asked, sent_at)
                    out.succeeded(len(req.prompt), sent, result, (prefill_name, decode_name), times)
                except BaseException:
                    if sending is not None and not sending.done():  # cancelled: prefill frees its side
                        sending.cancel()
                    await self._after_failure(rid, prefill_name, decode_name)
                    raise
        finally:
            self.router.end(prefill_name, decode_name)
            if await self._forget_fault(rid, planned_on):
                self.faults.struck[fault] += 1

    def lost(self, name: str) -> None:
        """Worker `name` was lost: its requests not yet sent to it are retried elsewhere."""
        if name in self.batchers:
            self.batchers[name].fail_pending(Retry(FailureKind.WORKER_LOST, f"{name} was lost"))

    async def _plan_fault(self, rid: str, fault: str | None, prefill_name: str) -> list[str]:
        """Plan the attempt's injected transfer fault (if any) where it strikes, through each worker's
        one seam (`plan_fault`): a sender fault on its prefill worker, a receiver fault on every live
        decode worker (the one that expects the transfer takes it; `corrupt_one_rank`: on its last
        rank only). The workers planned on."""
        handles: dict = self.dep.handles()
        if fault in SENDER_FAULTS:
            names = [prefill_name]
        elif fault in RECEIVER_FAULTS:
            names = self.router.alive(list(self.dep.decode))
        elif fault == CORRUPT_ONE_RANK:  # each decode worker's last rank only
            names = self.router.alive(list(self.dep.decode))
            handles, fault = {n: self.dep.ranks[n][-1] for n in names}, CORRUPT_PAYLOAD
        else:
            return []
        try:
            calls = (self.attempts.call(n, handles[n].plan_fault.remote(rid, fault)) for n in names)
            await asyncio.gather(*calls)
        except BaseException:
            await self._forget_fault(rid, names)
            raise
        return names

    async def _forget_fault(self, rid: str, names: list[str]) -> bool:
        """After the attempt: no plan it did not take is left for the next one. Returns whether a
        worker's transfer took the plan (it answered that it had none left to drop)."""
        handles = self.dep.handles()
        dropped = await asyncio.gather(
            *(self.attempts.quiet(handles[n].plan_fault.remote(rid, None)) for n in names)
        )
        return any(answer is False for answer in dropped)

    async def _prefill(self, name: str, item: PrefillItem) -> PrefillResult:
        """Prefill and send one request on prefill worker `name` (batched with others). Sent or
        failed, that worker freed the request's source: room may have freed there."""
        sent = await self.attempts.call(name, self.batchers[name].submit(item))
        if not isinstance(sent, PrefillBusy):
            self.attempts.room_freed()
        return sent

    async def _after_failure(self, rid: str, prefill_name: str, decode_name: str) -> None:
        """The destination is given up (the source was freed by prefill); a broken channel is rebuilt."""
        p, d = self.dep.prefill[prefill_name], self.dep.decode[decode_name]
        await self.attempts.quiet(d.cancel.remote(rid))
        if {prefill_name, decode_name} & self.router.dead:
            return
        lock = self.rebuild_locks.setdefault((prefill_name, decode_name), asyncio.Lock())
        async with lock:
            try:
                asked = (p.channel_broken.remote(decode_name), d.channel_broken.remote(prefill_name))
                broken = await asyncio.wait_for(asyncio.gather(*asked), self.attempts.silence_s)
                if any(broken):
                    await self.dep.connect_async(prefill_name, decode_name)
            except Exception as exc:
                # Not fatal: a pair that cannot reconnect fails its next transfer within its deadline,
                # and that request is retried on another pair. Say so, since it costs throughput.
                pair = f"{prefill_name}->{decode_name}"
                print(f"distpool: warning: channel {pair} not rebuilt: {exc}", flush=True)
