"""Serving a workload through a PD deployment: the driver's side (README, "How one request moves").

Per request, three driver <-> actor calls: reserve a destination on a decode worker with room,
the one caching the longest prefix of the prompt first (it then expects the envelope from the
chosen prefill worker) -> batched prefill + whole-envelope send
on that prefill worker (the transfer header carries the first token) -> the result, which arrives
through one long-poll per decode worker (`next_events`, which also streams tokens as decode makes
them). A failed transfer, a dead or silent actor
(`serving.deploy.recovery`) or no room frees both sides and retries the request on another pair (at most
`max_attempts` tries); anything else is a bug and fails the request at once. Requests wait in a
queue; `queue_bound` of them are in the pipeline at once. With conditional disaggregation
(`serving.routing.conditional`), a request whose prompt extends a state a decode worker kept may instead be
prefilled there (`DecodeWorker.local_prefill`), with no transfer; refused, it takes the path above.
One attempt on each path is `serving.path.remote_path` and `serving.path.local_path`, owned while it runs by
`serving.path.attempts` (a request that found no room waits there for room to free); the ways an attempt
ends without its result, `serving.path.attempt_errors`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from distpool.serving.deploy import Deployment, Recovery
from distpool.serving.metrics import DriverMetrics
from distpool.serving.outcome import Outcome, one_line
from distpool.serving.path.attempt_errors import Busy, GiveUp, Retry, decode_failure
from distpool.serving.path.attempts import Attempts
from distpool.serving.path.faults import FaultPlan
from distpool.serving.path.local_path import LocalPath
from distpool.serving.path.remote_path import RemotePath
from distpool.serving.path.request_stream import RequestStream
from distpool.serving.path.reservations import Reservations
from distpool.serving.routing import ConditionalOptions, NoWorkerAlive, Router
from distpool.serving.workloads import Request
from distpool.worker.messages import DecodeFailed
from transfer.wire import FailureKind

RESULT_WAIT_S = 1.0  # one long-poll per decode worker returns at least this often
FollowUp = Callable[[Request, Outcome], Request | None]  # the request an outcome unlocks, if any


@dataclass
class ServeOptions:
    faults: dict[str, float] = field(default_factory=dict)  # kind -> probability per attempt (path.faults)
    max_attempts: int = 4
    queue_bound: int = 64  # requests admitted into the pipeline at once
    admission_timeout_s: float = 60.0
    silence_s: float | None = None  # unanswered this long: ping it (deploy.recovery); None: transfer timeout
    seed: int = 0
    progress: bool = True
    # Reserve the destination while prefill computes (the transfer waits for it); False reserves
    # first (`--reserve-first`): kept so that scripts/bench_ttft.py measures both orders side by side.
    overlap_reservation: bool = True
    conditional: ConditionalOptions = ConditionalOptions()  # local prefill on decode (routing.conditional)


class ServerClosed(RuntimeError):
    """`submit` after the server stopped accepting requests (it drains, or it was closed)."""


class Server:
    """Serves requests as they are submitted, through one deployment: `start`, then `submit` each
    (a `RequestStream` to read), `cancel` by id, `drain` and `close`; `serve` does all of it for a
    list (the batch job). `streaming` has decode hand out tokens as it makes them (`next_events`)."""

    def __init__(self, deployment: Deployment, options: ServeOptions, *, streaming: bool = False) -> None:
        self.dep = deployment
        self.options = options
        self.streaming = streaming
        pool_args = deployment.spec.worker.pool_args
        self.router = Router(list(deployment.prefill), list(deployment.decode), page_size=pool_args.page_size)
        self.cache_affinity = pool_args.prefix_cache  # decode workers keep finished requests' pages
        self.faults = FaultPlan(options.faults, options.seed)
        self.recovery = Recovery(
            deployment, self.router, on_lost=self._fail_results_on, on_return=self._on_return
        )
        silence_s = options.silence_s or deployment.spec.worker.transfer.timeout_s
        self.attempts = Attempts(self.recovery, silence_s=silence_s)  # each request's attempt now
        self.reservations = Reservations(
            deployment,
            self.router,
            self.attempts,
            overlap=options.overlap_reservation,
            cache_affinity=self.cache_affinity,
            admission_timeout_s=options.admission_timeout_s,
        )
        # prefill on decode (conditional disaggregation), or None
        self.local = LocalPath.build(deployment, self.router, options.conditional, self.attempts)
        # prefill on a prefill worker, the envelope sent to decode
        self.remote = RemotePath(deployment, self.router, self.reservations, self.faults, self.attempts)
        self.background: list[asyncio.Task] = []
        self.result_streams: list[asyncio.Task] = []  # one `_results_from` per decode worker
        self.closing = False  # set once every request is done: the result streams stop
        self.accepting = False  # between `start` and `drain` / `close`
        self.outcomes: list[Outcome] = []  # of the requests that ended, as they end
        self.streams: dict[str, RequestStream] = {}  # request id -> its stream, while it is served
        self.tasks: dict[str, asyncio.Task] = {}  # request id -> the task serving it
        self.cancelling: dict[str, str] = {}  # request id -> why `cancel` cancelled it, until it ends
        self.slots: asyncio.Semaphore | None = None  # `queue_bound` requests in the pipeline at once
        self.admitted = 0  # requests past the waiting room (holding a slot) now
        self.retried = 0
        self.done = 0
        self.total = 0  # requests submitted (a conversation's follow-ups included)
        self.metrics = DriverMetrics()  # Prometheus, through Ray

    @property
    def waiting_count(self) -> int:
        """Requests submitted and not yet in the pipeline (waiting for one of `queue_bound` slots)."""
        return len(self.tasks) - self.admitted

    async def start(self) -> None:
        """Start the result streams (one per decode worker) and the progress lines; accept requests."""
        self.slots = asyncio.Semaphore(self.options.queue_bound)
        self.attempts.start()
        self.closing, self.accepting = False, True
        self.result_streams = [asyncio.create_task(self._results_from(name)) for name in self.dep.decode]
        self.background = [asyncio.create_task(self._progress_loop())]

    def submit(self, req: Request, follow_up: FollowUp | None = None) -> RequestStream:
        """Queue `req` (served once one of `queue_bound` slots is free, in order); its stream.
        `follow_up(request, outcome)`, called as it ends, may return a request that outcome unlocks
        (a conversation's next turn): it is submitted in turn. ServerClosed once draining; ValueError
        for a request id in flight already."""
        if not self.accepting:
            raise ServerClosed("the server is not accepting requests (it is draining or closed)")
        rid = req.request_id
        if rid in self.tasks:
            raise ValueError(f"request id {rid!r} is in flight already")
        stream = self.streams[rid] = RequestStream(rid)
        self.total += 1
        self.tasks[rid] = asyncio.get_running_loop().create_task(self._serve_request(req, stream, follow_up))
        return stream

    def cancel(self, request_id: str, why: str = "cancelled") -> bool:
        """Cancel a request wherever it is (waiting, prefilling, moving, decoding): what it holds on
        every worker is freed, and it ends with a cancelled outcome whose error is `why`. Whether it
        was in flight (and not cancelled already)."""
        task = self.tasks.get(request_id)
        if task is None or request_id in self.cancelling:
            return False
        self.cancelling[request_id] = why
        task.cancel()
        return True

    async def drain(self, timeout_s: float, why: str = "drained") -> int:
        """Stop accepting requests; let those in flight end for up to `timeout_s`, then cancel the
        rest (`why`), and wait for them to let go. How many were cancelled."""
        self.accepting = False
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=timeout_s)
        left = [rid for rid in list(self.tasks) if self.cancel(rid, why)]
        await self.wait_idle()
        return len(left)

    async def wait_idle(self) -> None:
        """Until no request is in flight (follow-ups included)."""
        while self.tasks:
            done, _ = await asyncio.wait(list(self.tasks.values()), return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # a bug in the driver itself, raised here

    async def close(self) -> None:
        """Stop accepting; let each long-poll return (a call left behind would take the results of
        the next `start` on this deployment and hand them to nobody); cancel what runs beside."""
        self.accepting = False
        try:
            await self.recovery.settle()  # a worker restarting now is reported as it ends up
            self.closing = True
            if self.result_streams:
                await asyncio.wait(self.result_streams, timeout=RESULT_WAIT_S + 30)
        finally:
            self._stop_background()

    def _stop_background(self) -> None:
        for task in (
            *self.tasks.values(),
            *self.result_streams,
            *self.background,
            *self.attempts.background,
            *self.recovery.rejoining.values(),
        ):
            task.cancel()

    async def serve(self, requests: list[Request], follow_up: FollowUp | None = None) -> list[Outcome]:
        """Serve `requests`, at most `queue_bound` at once, in order; outcomes sorted by request id.

        `follow_up(request, outcome)`, called as each request ends, may return a request that outcome
        unlocks (a conversation's next turn): it is queued behind those already waiting."""
        self.outcomes = []
        self.total = 0
        await self.start()
        try:
            for req in requests:
                self.submit(req, follow_up)
            await self.wait_idle()
            await self.close()
        finally:
            self._stop_background()  # after Ctrl-C: nothing is left running on the loop
        return sorted(self.outcomes, key=lambda o: o.request_id)

    async def _serve_request(self, req: Request, stream: RequestStream, follow_up: FollowUp | None) -> None:
        rid = req.request_id
        if self.slots is None:
            raise RuntimeError("Server.start() comes first")
        try:
            try:
                async with self.slots:
                    self.admitted += 1
                    try:
                        out = await self._serve_one(req)
                    finally:
                        self.admitted -= 1
                if out.tokens is None and rid in self.cancelling:  # its cancellation ended it as an error
                    out = self._cancelled(rid)
            except asyncio.CancelledError:
                if rid not in self.cancelling:
                    raise  # the loop is ending (Ctrl-C): the request is unfinished, not failed
                out = self._cancelled(rid)
        finally:
            self.tasks.pop(rid, None)
            self.streams.pop(rid, None)
            self.cancelling.pop(rid, None)
        self.outcomes.append(out)
        self._record(out)
        stream.end(out)
        if follow_up is not None and self.accepting and (after := follow_up(req, out)) is not None:
            self.submit(after, follow_up)

    def _cancelled(self, rid: str) -> Outcome:
        out = Outcome(request_id=rid, error=self.cancelling[rid], failure=FailureKind.ABORTED)
        out.cancelled = True
        return out

    def _record(self, out: Outcome) -> None:
        self.done += 1
        if out.cancelled:
            self.metrics.count("cancelled")
            return
        if self.local is not None and out.tokens is not None:
            self.local.record(out)
        if out.tokens is not None:
            self.metrics.observe_ttft(out.ttft_s, out.path)
        self.metrics.count("completed" if out.tokens is not None else "corrupt" if out.corrupt else "failed")

    async def _serve_one(self, req: Request) -> Outcome:
        # A request without a seed of its own samples with one drawn from the run's seed and its id:
        # set here, once, it travels to prefill and decode with the request's parameters.
        req = dataclasses.replace(req, params=req.params.with_seed(self.options.seed, req.request_id))
        out = Outcome(request_id=req.request_id, seed=req.params.seed)
        submitted = time.monotonic()
        avoid: set[str] = set()
        admit_by = submitted + self.options.admission_timeout_s
        while out.attempts < self.options.max_attempts:
            out.attempts += 1
            room = self.attempts.room  # set once room frees (or a worker returns) after this try began
            try:
                await self._attempt(req, out, submitted, avoid)
                return out
            except NoWorkerAlive as exc:
                if not self.recovery.pending or time.monotonic() > admit_by:
                    out.error, out.failure = str(exc), FailureKind.WORKER_LOST
                    return out
                out.attempts -= 1  # waiting for a lost worker to come back is not a failed attempt
                await self._wait_for_rejoin(room, admit_by)
            except Busy as exc:
                out.attempts -= 1
                if time.monotonic() > admit_by:
                    out.error = f"not admitted within {self.options.admission_timeout_s} s: {exc}"
                    out.failure = FailureKind.NOT_ADMITTED
                    return out
                await self.attempts.wait_for(room, admit_by - time.monotonic())
            except GiveUp as exc:
                out.error, out.failure = str(exc), exc.kind
                out.corrupt = exc.kind is FailureKind.CORRUPT
                return out
            except Retry as exc:  # both sides already freed what they held
                out.error, out.failure = str(exc), exc.kind
                if out.attempts < self.options.max_attempts:
                    out.retried_after.append(exc.kind)
                    self.retried += 1
                    self.metrics.count("retried")
            except Exception as exc:  # a bug, not bad luck: retrying would only repeat it
                out.error, out.failure = one_line(exc), FailureKind.INTERNAL
                return out
        return out

    async def _attempt(self, req: Request, out: Outcome, submitted: float, avoid: set[str]) -> None:
        if self.local is not None and (local := await self.local.attempt(req, out, submitted, avoid)):
            if isinstance(local, DecodeFailed):
                raise decode_failure(local)
            return
        await self.remote.attempt(req, out, submitted, avoid)

    async def _wait_for_rejoin(self, room: asyncio.Event, admit_by: float) -> None:
        """Until a lost worker comes back (`room` is set) or gives up rejoining, or `admit_by`."""
        rejoining = [task for task in self.recovery.rejoining.values() if not task.done()]
        returned = asyncio.ensure_future(room.wait())
        try:
            timeout_s = max(admit_by - time.monotonic(), 0.0)
            await asyncio.wait([returned, *rejoining], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            returned.cancel()

    def _fail_results_on(self, lost: str) -> None:
        """Worker `lost` was lost: what waits on it fails (and is retried)."""
        self.remote.lost(lost)
        self.attempts.fail_on(lost)

    def _on_return(self, name: str) -> None:
        self.attempts.room_freed()  # what waits for a worker of its role tries again
        if name in self.dep.decode:  # its result stream ended when it was lost
            self.result_streams.append(asyncio.get_running_loop().create_task(self._results_from(name)))

    async def _results_from(self, name: str) -> None:
        """One outstanding `next_events` per decode worker: results arrive as requests finish, and
        (streaming) tokens as they are made."""
        handle = self.dep.decode[name]
        while name not in self.router.dead and not self.closing:
            try:
                asked = handle.next_events.remote(RESULT_WAIT_S, self.streaming)
                events = await self.attempts.call(name, asked)
            except Retry:
                return
            self.router.learned(name, events.cache)  # before its results: the view is decode's then
            for rid, (start, tokens) in events.tokens.items():
                if self.attempts.waits_on(name, rid) and (stream := self.streams.get(rid)):
                    stream.offer(start, tokens)
            self.attempts.deliver(name, events.finished)

    async def _progress_loop(self) -> None:
        while self.options.progress:
            await asyncio.sleep(1.0)
            print(f"  progress: {self.done}/{self.total} requests done, {self.retried} retried", flush=True)
