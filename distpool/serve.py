"""Serving a workload through a PD deployment (the driver side of design.md's "PD flow").

Per request: reserve a destination on a decode worker with room -> batched prefill on the least-loaded
prefill worker -> whole-envelope transfer over the pair's channel -> continuous-batching decode ->
collect tokens. A failed transfer or a dead actor frees both sides and retries the request on another
pair (at most `max_attempts` tries); requests wait in a bounded queue when every pool is full.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError

from distpool.launcher import Deployment
from distpool.pool import DoesNotFit
from distpool.router import NoWorkerAlive, Router
from distpool.workload import Request

ADMISSION_POLL_S = 0.005
COLLECT_POLL_S = 0.005
PREFILL_BATCH = 8


@dataclass
class Outcome:
    request_id: str
    tokens: list[int] | None = None
    error: str | None = None
    attempts: int = 0
    ttft_s: float = 0.0  # submit -> first token available on the decode worker
    decode_s: float = 0.0  # first token -> last token
    transfer_bytes: int = 0
    transfer_s: float = 0.0


@dataclass
class ServeOptions:
    fault_rate: float = 0.0  # probability that a transfer is aborted mid-stream (then retried)
    max_attempts: int = 4
    queue_bound: int = 64  # requests admitted into the pipeline at once
    admission_timeout_s: float = 60.0
    seed: int = 0
    progress: bool = True


class _Busy(Exception):
    """A pool had no room right now: wait and try again; this does not count as a failed attempt."""


class _Dead(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"{name} died")
        self.name = name


@dataclass
class _Batcher:
    """Collects prefill requests for one worker and runs them as one batch."""

    handle: ray.actor.ActorHandle
    pending: list[tuple[str, list[int], asyncio.Future]] = field(default_factory=list)
    running: bool = False

    async def submit(self, rid: str, prompt: list[int]) -> int | str:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((rid, prompt, future))
        if not self.running:
            self.running = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self.pending:
                await asyncio.sleep(0)  # let requests that arrive together join the batch
                batch, self.pending = self.pending[:PREFILL_BATCH], self.pending[PREFILL_BATCH:]
                try:
                    out = await self.handle.prefill.remote([(rid, prompt) for rid, prompt, _ in batch])
                    for rid, _, fut in batch:
                        fut.set_result(out[rid])
                except Exception as exc:
                    for _, _, fut in batch:
                        fut.set_exception(exc)
        finally:
            self.running = False


class Server:
    def __init__(self, deployment: Deployment, options: ServeOptions) -> None:
        self.dep = deployment
        self.options = options
        self.router = Router(list(deployment.prefill), list(deployment.decode))
        self.rng = random.Random(options.seed)
        self.batchers = {name: _Batcher(h) for name, h in deployment.prefill.items()}
        self.pair_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.results: dict[str, asyncio.Future] = {}
        self.retried = 0
        self.done = 0

    async def serve(self, requests: list[Request]) -> list[Outcome]:
        queue: asyncio.Queue[Request | None] = asyncio.Queue(maxsize=self.options.queue_bound)
        outcomes: list[Outcome] = []
        collector = asyncio.create_task(self._collect_loop())
        progress = asyncio.create_task(self._progress_loop(len(requests)))

        async def worker() -> None:
            while (req := await queue.get()) is not None:
                outcomes.append(await self._serve_one(req))
                self.done += 1

        workers = [asyncio.create_task(worker()) for _ in range(self.options.queue_bound)]
        try:
            for req in requests:
                await queue.put(req)  # blocks when the pipeline is full: backpressure
            for _ in workers:
                await queue.put(None)
            await asyncio.gather(*workers)
        finally:
            for task in (*workers, collector, progress):
                task.cancel()
        return sorted(outcomes, key=lambda o: o.request_id)

    async def _serve_one(self, req: Request) -> Outcome:
        out = Outcome(request_id=req.request_id)
        submitted = time.monotonic()
        avoid: set[str] = set()
        while out.attempts < self.options.max_attempts:
            out.attempts += 1
            try:
                await self._attempt(req, out, submitted, avoid)
                return out
            except NoWorkerAlive as exc:
                out.error = str(exc)
                return out
            except _Busy as exc:
                out.attempts -= 1
                if time.monotonic() - submitted > self.options.admission_timeout_s:
                    out.error = f"not admitted within {self.options.admission_timeout_s} s: {exc}"
                    return out
                await asyncio.sleep(ADMISSION_POLL_S)
            except Exception as exc:  # a failed transfer or a dead actor: both sides already freed
                out.error = f"{type(exc).__name__}: {exc}"
                if out.attempts < self.options.max_attempts:
                    self.retried += 1
        return out

    async def _attempt(self, req: Request, out: Outcome, submitted: float, avoid: set[str]) -> None:
        rid = req.request_id
        decode_name, destination = await self._reserve_decode(req, avoid)
        prefill_name = self.router.pick_prefill()
        self.router.begin(prefill_name)
        try:
            first = await self._call(prefill_name, self.batchers[prefill_name].submit(rid, req.prompt))
            if isinstance(first, str):  # the prefill pool is full: give the destination back, try again
                raise _Busy(first)
            fault = 0 if self.rng.random() < self.options.fault_rate else None
            prefill, decode = self.dep.prefill[prefill_name], self.dep.decode[decode_name]
            lock = self.pair_locks.setdefault((prefill_name, decode_name), asyncio.Lock())
            async with lock:
                sent, received = await asyncio.gather(
                    self._call(prefill_name, prefill.send.remote(rid, decode_name, destination, fault)),
                    self._call(decode_name, decode.receive.remote(rid, prefill_name, first)),
                    return_exceptions=True,
                )
            for result in (sent, received):
                if isinstance(result, BaseException):
                    avoid.add(decode_name)
                    raise result
            out.ttft_s = time.monotonic() - submitted
            out.transfer_bytes, out.transfer_s = received["bytes"], received["seconds"]
            future = asyncio.get_running_loop().create_future()
            self.results[rid] = (decode_name, future)
            result = await future
            out.tokens, out.decode_s, out.error = result["tokens"], result["decode_s"], None
        except BaseException:
            await self._after_failure(rid, prefill_name, decode_name)
            raise
        finally:
            self.router.end(prefill_name, decode_name)

    async def _reserve_decode(self, req: Request, avoid: set[str]) -> tuple[str, bytes]:
        deadline = time.monotonic() + self.options.admission_timeout_s
        while True:
            for name in self.router.decode_candidates(avoid):
                # Counted as in flight from the moment of asking, so concurrent requests spread out.
                self.router.begin(name)
                try:
                    ref = self.dep.decode[name].reserve.remote(
                        req.request_id, len(req.prompt), req.max_new_tokens
                    )
                    return name, await self._call(name, ref)
                except _Dead:
                    self.router.end(name)
                    continue
                except DoesNotFit:
                    self.router.end(name)
                except BaseException:
                    self.router.end(name)
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no decode worker had room for {req.request_id} within the admission timeout"
                )
            await asyncio.sleep(ADMISSION_POLL_S)

    async def _call(self, name: str, awaitable):
        try:
            return await awaitable
        except RayActorError as exc:
            self.router.mark_dead(name)
            self._fail_results_on(name)
            raise _Dead(name) from exc

    async def _quiet(self, ref) -> None:
        try:
            await ref
        except Exception:  # the peer is gone or never held it: nothing left to free there
            pass

    async def _after_failure(self, rid: str, prefill_name: str, decode_name: str) -> None:
        """Both sides free what they hold (idempotent); a broken channel is rebuilt."""
        p, d = self.dep.prefill[prefill_name], self.dep.decode[decode_name]
        await asyncio.gather(self._quiet(p.drop.remote(rid)), self._quiet(d.cancel.remote(rid)))
        if {prefill_name, decode_name} & self.router.dead:
            return
        lock = self.pair_locks.setdefault((prefill_name, decode_name), asyncio.Lock())
        async with lock:
            try:
                broken = await asyncio.gather(
                    p.channel_broken.remote(decode_name), d.channel_broken.remote(prefill_name)
                )
                if any(broken):
                    await asyncio.gather(*self.dep.connect(prefill_name, decode_name))
            except Exception as exc:
                # Not fatal: a pair that cannot reconnect fails its next transfer within its deadline,
                # and that request is retried on another pair. Say so, since it costs throughput.
                pair = f"{prefill_name}->{decode_name}"
                print(f"distpool: warning: channel {pair} not rebuilt: {exc}", flush=True)

    def _fail_results_on(self, decode_name: str) -> None:
        for rid, (name, future) in list(self.results.items()):
            if name == decode_name and not future.done():
                future.set_exception(_Dead(decode_name))
                del self.results[rid]

    async def _collect_loop(self) -> None:
        while True:
            by_worker: dict[str, list[str]] = {}
            for rid, (name, _) in self.results.items():
                by_worker.setdefault(name, []).append(rid)
            for name, rids in by_worker.items():
                try:
                    done = await self._call(name, self.dep.decode[name].collect.remote(rids))
                except _Dead:
                    continue
                for rid, result in done.items():
                    _, future = self.results.pop(rid)
                    future.set_result(result)
            await asyncio.sleep(COLLECT_POLL_S)

    async def _progress_loop(self, total: int) -> None:
        while self.options.progress:
            await asyncio.sleep(1.0)
            print(f"  progress: {self.done}/{total} requests done, {self.retried} retried", flush=True)
