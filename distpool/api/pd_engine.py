"""The engine over a PD deployment (`PdEngine`): the front end's `Engine` protocol served by the driver
(`serving.driver.Server`) in the process that hosts it, with tokens streamed as decode makes them.

    engine = PdEngine(EngineSetup(spec, options, served_name, tokenizer_folder))  # starts the workers
    async for event in engine.generate(rid, ids, args): ...                       # one request
    summary = await engine.drain(timeout_s)                                        # at shutdown

Hosted as the one replica of a Ray Serve deployment (`serve_app`), it is the home of what the
requests share: the router, the reservations, what the driver knows of each decode worker's cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from distpool.serving.deployment import Deployment, DeploymentSpec
from distpool.serving.driver import ServeOptions, Server, ServerClosed
from distpool.serving.outcome import Outcome
from distpool.serving.recovery import PING_TIMEOUT_S
from distpool.serving.report import leak_counts
from distpool.serving.run import drop_prefix_caches, worker_stats
from distpool.serving.workload import Request

DRAINING_RETRY_AFTER_S = 5  # a request that comes while the server drains: try another server soon


@dataclass(frozen=True)
class EngineSetup:
    """What the engine is built from (it crosses to the engine's replica as it is)."""

    spec: DeploymentSpec
    options: ServeOptions
    served_name: str
    tokenizer_folder: str | None = None  # the checkpoint folder with its tokenizer, if it has one


@dataclass
class _Served:
    """The engine's counts, for the summary at shutdown."""

    served: int = 0
    cancelled: int = 0  # by their clients (a closed stream) or by the drain
    failed: int = 0


def _finish_reason(outcome: Outcome) -> tuple[FinishReason, int | None]:
    finish = outcome.finish
    if finish is not None and finish.reason == "stop":
        return FinishReason.STOP, finish.stop_token
    return FinishReason.LENGTH, None


class PdEngine:
    def __init__(self, setup: EngineSetup) -> None:
        self.setup = setup
        self.deployment = Deployment.start(setup.spec)  # the workers, their channels built
        self.server = Server(self.deployment, setup.options, streaming=True)
        self.counts = _Served()
        self._started: asyncio.Task | None = None
        self._draining = False

    async def _running(self) -> Server:
        if self._started is None:  # on the loop that serves the requests
            self._started = asyncio.ensure_future(self.server.start())
        await self._started
        return self.server

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
        server = await self._running()
        try:
            stream = server.submit(Request(request_id, list(prompt_ids), params=args))
        except ServerClosed:
            raise EngineBusy(DRAINING_RETRY_AFTER_S) from None
        ended, last_at, gaps = False, None, []
        try:
            async for delta in stream.deltas():
                now = time.monotonic()
                if delta.tokens and last_at is not None:
                    gaps.append(now - last_at)
                last_at = now if delta.tokens else last_at
                if (outcome := delta.outcome) is None:
                    yield TokenEvent(tuple(delta.tokens))
                    continue
                ended = True
                if outcome.tokens is None:
                    self._count_failed(outcome)
                    why = "the server is shutting down" if outcome.cancelled else outcome.error or "failed"
                    raise RequestFailed(request_id, why)
                self.counts.served += 1
                ttft = stream.first_token_at - stream.submitted_at if stream.first_token_at else None
                server.metrics.observe_stream(ttft, gaps, now - stream.submitted_at)
                reason, stop_id = _finish_reason(outcome)
                yield TokenEvent(tuple(delta.tokens), reason, stop_token_id=stop_id)
        finally:
            if not ended and server.cancel(request_id):  # the client left, or a stop string matched
                self.counts.cancelled += 1
            server.metrics.set_load(server.admitted, server.waiting_count)

    def _count_failed(self, outcome: Outcome) -> None:
        if outcome.cancelled:
            self.counts.cancelled += 1
        else:
            self.counts.failed += 1

    async def abort(self, request_id: str) -> None:
        """A stop string matched in its text: the request ends there, served."""
        if self.server.cancel(request_id):
            self.counts.served += 1

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
        is dropped (a leak). The summary: served, cancelled, failed, leaked pages and slots."""
        server = await self._running()
        await server.drain(timeout_s)
        await server.close()
        lost = server.router.dead
        readings = await asyncio.to_thread(
            lambda: drop_prefix_caches(self.deployment, worker_stats(self.deployment, lost=lost))
        )
        leaks = leak_counts(readings)
        return {
            **dataclasses.asdict(self.counts),
            "leaked_pages": leaks["leaked_pages"],
            "leaked_slots": leaks["leaked_slots"],
            "retried": server.retried,
        }

    async def stop_workers(self) -> None:
        """Stop the workers (after `drain`). (Not `shutdown`: a Serve handle keeps that name.)"""
        await asyncio.to_thread(self.deployment.shutdown)
