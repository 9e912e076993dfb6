"""An `Engine` that is a Ray Serve deployment: its handle's calls as the protocol's coroutines.

The engine deployment implements the same methods (`model_card`, `generate` as an async generator,
`abort`, `health`); `generate` is called as a streaming call, and closing the stream cancels the
call on the engine's replica (its generator sees asyncio.CancelledError).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray.exceptions import RayTaskError

from distpool.api.engine import EngineBusy, GenerationArgs, Health, ModelCard, RequestFailed, TokenEvent


class HandleEngine:
    def __init__(self, handle) -> None:  # ray.serve.handle.DeploymentHandle
        self._handle = handle

    async def model_card(self) -> ModelCard:
        return await self._handle.model_card.remote()

    async def generate(
        self, request_id: str, prompt_ids: tuple[int, ...], args: GenerationArgs
    ) -> AsyncIterator[TokenEvent]:
        stream = self._handle.options(stream=True).generate.remote(request_id, prompt_ids, args)
        finished = False
        try:
            async for event in stream:
                finished = event.is_last  # closed after this one: nothing left to cancel
                yield event
        except RayTaskError as exc:  # the engine's own refusal or failure, as the protocol says it
            if isinstance(exc.cause, (EngineBusy, RequestFailed)):
                raise exc.cause from None
            raise
        finally:
            if not finished:
                stream.cancel()

    async def abort(self, request_id: str) -> None:
        await self._handle.abort.remote(request_id)

    async def health(self) -> Health:
        return await self._handle.health.remote()
