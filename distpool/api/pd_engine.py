"""The engine over a PD deployment (`PdEngine`): the front end's `Engine` protocol served by the driver
(`serving.path.driver.Server`) in the process that hosts it, with tokens streamed as decode makes them.

    engine = PdEngine(EngineSetup(spec, options, served_name, tokenizer_folder))  # starts the workers
    async for event in engine.generate(rid, ids, args): ...                       # one request
    summary = await engine.drain(timeout_s)                                        # at shutdown

Hosted as the one replica of a Ray Serve deployment (`serve_app`), it is the home of what the
requests share: the router, the reservations, what the driver knows of each decode worker's cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from distpool.api.engine import (
    EngineBusy,
    FinishReason,
    GenerationArgs,
    Health,
    ModelCard,
    RequestFailed,
    TokenEvent,
    WorkerHealth,
)
from distpool.serving.deploy import PING_TIMEOUT_S, Deployment, DeploymentSpec
from distpool.serving.job import drop_prefix_caches, worker_stats
from distpool.serving.outcome import Outcome
from distpool.serving.path import ServeOptions, Server, ServerClosed
from distpool.serving.summary import TTFT_PARTS, leak_counts, percentile
from distpool.serving.workloads import Request

DRAINING_RETRY_AFTER_S = 5  # a request that comes while the server drains: try another server soon


@dataclass(frozen=True)
class EngineSetup:
    """What the engine is built from (it crosses to the engine's replica as it is)."""

    spec: DeploymentSpec
    options: ServeOptions
    served_name: str
    tokenizer_folder: str | None = None  # the checkpoint folder with its tokenizer, if it has one


STOPPED = "stopped"  # why a request cancelled for a stop string matched in its text (it was served)


def served_counts(outcomes: list[Outcome]) -> dict[str, int]:
    """Served (a stop string's cancellation included), cancelled (a client left, or the drain) and
    failed requests, from the driver's outcomes."""
    stopped = sum(o.cancelled and o.error == STOPPED for o in outcomes)
    cancelled = sum(o.cancelled for o in outcomes) - stopped
    served = sum(o.tokens is not None for o in outcomes) + stopped
    return {"served": served, "cancelled": cancelled, "failed": len(outcomes) - served - cancelled}


def _finish_reason(outcome: Outcome) -> tuple[FinishReason, int | None]:
    finish = outcome.finish
    if finish is not None and finish.reason == "stop":
        return FinishReason.STOP, finish.stop_token
    return FinishReason.LENGTH, None


def ttft_parts_ms(outcomes: list[Outcome]) -> dict[str, float]:
    """Where the served requests' time to first token went, as the driver measured it: the median
    of each part (queue, reserve, prefill, transfer, first_token) in ms, and their count."""
    done = [o for o in outcomes if o.tokens is not None]
    parts = {
        part: round(percentile([getattr(o, f"{part}_s") * 1e3 for o in done], 50), 1) for part in TTFT_PARTS
    }
    return {**parts, "requests": len(done)}


def _holding(stats) -> str:
    """The requests a worker still holds, by state (a decode worker's), for a leak's report."""
    states = ("waiting", "prefilling", "arrived", "running", "finished_uncollected")
    return ", ".join(f"{getattr(stats, k)} {k}" for k in states if getattr(stats, k, 0))


class _Failed:
    """An exception raised on the driver's loop, handed to the caller's."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class PdEngine:
    """The driver runs on a loop of its own, in a thread of the engine's process: every call it makes
    to a worker is made there, outside any Serve request's context, so that a request Serve cancels
    (its client left) cancels nothing but that request, through the driver. (Ray cancels what a
    cancelled task started: a prefill batch other requests share, or a decode worker's result
    stream.)"""

    def __init__(self, setup: EngineSetup) -> None:
        self.setup = setup
        self.deployment = Deployment.start(setup.spec)  # the workers, their channels built
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="distpool-driver", daemon=True)
        self._thread.start()
        self.server: Server = self._on_driver(self._start()).result()

    async def _start(self) -> Server:
        server = Server(self.deployment, self.setup.options, streaming=True)
        await server.start()
        return server

    def _on_driver(self, coro) -> concurrent.futures.Future:
        """Run `coro` on the driver's loop, in a context of its own: Ray reads the task a call is
        made for from the context, so calls made in a Serve request's context would be cancelled
        with that request, whoever they serve (a prefill batch is shared)."""
        return contextvars.Context().run(asyncio.run_coroutine_threadsafe, coro, self._loop)

    def _soon(self, callback, *args) -> None:
        """Call `callback(*args)` on the driver's loop, outside any request's context."""
        self._loop.call_soon_threadsafe(callback, *args, context=contextvars.Context())

    async def model_card(self) -> ModelCard:
        worker = self.setup.spec.worker
        return ModelCard(
            served_name=self.setup.served_name,
            context_len=worker.pool_args.context_len,
            vocab_size=worker.spec.vocab_size,
            eos_token_ids=tuple(worker.eos_token_ids),
            tokenizer_folder=self.setup.tokenizer_folder,
        )

    async def generate(
        self, request_id: str, prompt_ids: tuple[int, ...], args: GenerationArgs
    ) -> AsyncIterator[TokenEvent]:
        caller, deltas = asyncio.get_running_loop(), asyncio.Queue()
        request = Request(request_id, list(prompt_ids), params=args)
        self._on_driver(
            self._pump(request, lambda item: caller.call_soon_threadsafe(deltas.put_nowait, item))
        )
        ended = False
        try:
            while True:
                item = await deltas.get()
                if isinstance(item, _Failed):
                    ended = True
                    raise item.error
                if (outcome := item.outcome) is None:
                    yield TokenEvent(tuple(item.tokens))
                    continue
                ended = True
                reason, stop_id = _finish_reason(outcome)
                yield TokenEvent(tuple(item.tokens), reason, stop_token_id=stop_id)
                return
        finally:
            if not ended:  # the client left, or a stop string matched (`abort` came first)
                self._soon(self.server.cancel, request_id, "cancelled")

    async def _pump(self, request: Request, put) -> None:
        """On the driver's loop: submit `request` and hand its deltas to `put` (a failure, or a
        refusal, as `_Failed`); record what the caller saw."""
        rid, server = request.request_id, self.server
        try:
            stream = server.submit(request)
        except ServerClosed:
            put(_Failed(EngineBusy(DRAINING_RETRY_AFTER_S)))
            return
        last_at, gaps = None, []
        async for delta in stream.deltas():
            now = time.monotonic()
            if delta.tokens and last_at is not None:
                gaps.append(now - last_at)
            last_at = now if delta.tokens else last_at
            outcome = delta.outcome
            if outcome is not None and outcome.tokens is None:
                why = "the server is shutting down" if outcome.cancelled else outcome.error or "failed"
                put(_Failed(RequestFailed(rid, why)))
                break
            if outcome is not None:
                ttft = stream.first_token_at - stream.submitted_at if stream.first_token_at else None
                server.metrics.observe_stream(ttft, gaps, now - stream.submitted_at)
            put(delta)
        server.metrics.set_load(server.admitted, server.waiting_count)

    async def abort(self, request_id: str) -> None:
        """A stop string matched in its text: the request ends there, served."""
        self._soon(self.server.cancel, request_id, STOPPED)

    async def health(self) -> Health:
        """Every worker's rank pinged at once; one that does not answer within PING_TIMEOUT_S, or is
        lost, is named."""
        handles = self.deployment.rank_handles()
        lost = self.server.router.dead

        async def ping(name: str, handle) -> WorkerHealth:
            if self.deployment.worker_of(name) in lost:
                return WorkerHealth(name, False, "lost; restarting")
            try:
                await asyncio.wait_for(handle.ping.remote(), PING_TIMEOUT_S)
                return WorkerHealth(name, True)
            except asyncio.TimeoutError:
                return WorkerHealth(name, False, f"no answer within {PING_TIMEOUT_S:g} s")
            except Exception as exc:
                return WorkerHealth(name, False, f"{type(exc).__name__}")

        return Health(tuple(await asyncio.gather(*(ping(n, h) for n, h in handles.items()))))

    async def load(self) -> dict[str, int]:
        """Requests in the pipeline and waiting for it, now."""
        return {"running": self.server.admitted, "waiting": self.server.waiting_count}

    async def drain(self, timeout_s: float) -> dict:
        """Stop taking requests; let those in flight finish for up to `timeout_s`, cancel the rest
        (their streams end with an error); then what every worker still holds once its prefix cache
        is dropped (a leak). The summary: served, cancelled, failed, leaked pages and slots, and
        which worker holds them."""
        return await asyncio.wrap_future(self._on_driver(self._drain(timeout_s)))

    async def _drain(self, timeout_s: float) -> dict:
        server = self.server
        await server.drain(timeout_s, why="drained")
        await server.close()
        lost = server.router.dead
        readings = await asyncio.to_thread(
            lambda: drop_prefix_caches(self.deployment, worker_stats(self.deployment, lost=lost))
        )
        leaks = leak_counts(readings)
        held = {
            r.name: (r.stats.pages_used, r.stats.slots_used, _holding(r.stats))
            for r in readings
            if r.stats is not None and (r.stats.pages_used or r.stats.slots_used)
        }
        return {
            **served_counts(server.outcomes),
            "leaked_pages": leaks["leaked_pages"],
            "leaked_slots": leaks["leaked_slots"],
            "held_by": held,
            "retried": server.retried,
            "errors": sorted({o.error for o in server.outcomes if o.tokens is None and not o.cancelled})[:5],
            "ttft_parts_ms": ttft_parts_ms(server.outcomes),
        }

    async def stop_workers(self) -> None:
        """Stop the workers and the driver's loop (after `drain`). (Not `shutdown`: a Serve handle
        keeps that name.)"""
        await asyncio.to_thread(self.deployment.shutdown)
        self._soon(self._loop.stop)
