"""A deterministic engine for the front end's tests: each request yields a scripted reply one token
per event with small delays, stops as issue 35's rules say, and records what happened to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

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


def echo_reply(prompt_ids: Sequence[int], args: GenerationArgs) -> list[int]:
    """The default reply: the prompt's ids again, over and over."""
    return [prompt_ids[i % len(prompt_ids)] for i in range(args.max_tokens)]


class FakeEngine:
    def __init__(
        self,
        card: ModelCard,
        reply: Callable[[Sequence[int], GenerationArgs], list[int]] = echo_reply,
        *,
        first_delay_s: float = 0.01,
        step_delay_s: float = 0.005,
        workers: Sequence[WorkerHealth] = (WorkerHealth("prefill-0", True), WorkerHealth("decode-0", True)),
        fail_after: int | None = None,
        busy: bool = False,
    ) -> None:
        self.card, self.reply = card, reply
        self.first_delay_s, self.step_delay_s = first_delay_s, step_delay_s
        self.workers = tuple(workers)
        self.fail_after, self.busy = fail_after, busy
        self.started: list[str] = []
        self.args: dict[str, GenerationArgs] = {}
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.aborted: list[str] = []
        self.events_sent: dict[str, int] = {}

    async def model_card(self) -> ModelCard:
        return self.card

    async def generate(
        self, request_id: str, prompt_ids: tuple[int, ...], args: GenerationArgs
    ) -> AsyncIterator[TokenEvent]:
        if self.busy:
            raise EngineBusy(retry_after_s=3)
        self.started.append(request_id)
        self.args[request_id] = args
        self.prompts[request_id] = prompt_ids
        tokens = self.reply(prompt_ids, args)[: args.max_tokens]
        stops = set(args.stop_token_ids) | (set() if args.ignore_eos else set(self.card.eos_token_ids))
        try:
            for i, token in enumerate(tokens):
                await asyncio.sleep(self.first_delay_s if i == 0 else self.step_delay_s)
                if self.fail_after is not None and i == self.fail_after:
                    raise RequestFailed(request_id, "decode-0 was lost")
                if request_id in self.aborted:
                    return
                self.events_sent[request_id] = i + 1
                if i + 1 > args.min_tokens and token in stops:
                    self.finished.append(request_id)
                    yield TokenEvent((token,), FinishReason.STOP, stop_token_id=token)
                    return
                if i + 1 == len(tokens):
                    self.finished.append(request_id)
                    yield TokenEvent((token,), FinishReason.LENGTH)
                    return
                yield TokenEvent((token,))
        except (asyncio.CancelledError, GeneratorExit):
            if request_id not in self.finished:  # closed after its last event: not a cancellation
                self.cancelled.append(request_id)
            raise

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> Health:
        return Health(workers=self.workers)
