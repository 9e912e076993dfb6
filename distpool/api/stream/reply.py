"""A request's answer, streamed as server-sent events or whole: the engine's deltas in OpenAI's
shapes, with usage. An engine failure becomes an error (an `error` event on a stream)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from distpool.api.admission import busy
from distpool.api.engine import EngineBusy, RequestFailed
from distpool.api.errors import SERVER, ApiError
from distpool.api.stream import responses
from distpool.api.stream.choice import ChoiceJob, TextDelta
from distpool.api.stream.responses import ResponseHead
from distpool.api.stream.sse import DONE, sse_data

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ReplyPlan:
    """What the answer needs beside the deltas."""

    head: ResponseHead
    jobs: tuple[ChoiceJob, ...]
    include_usage: bool
    show_token_ids: bool  # a model without a tokenizer: choices carry their ids

    @property
    def prompt_tokens(self) -> int:
        return sum(len(job.prompt_ids) for job in self.jobs)


def engine_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):  # the waiting room's 503
        return exc
    if isinstance(exc, EngineBusy):
        return busy(exc.retry_after_s, "the engine is at capacity")
    if isinstance(exc, RequestFailed):
        return ApiError(
            status=500, message=f"generation failed: {exc.reason}", type=SERVER, code="generation_failed"
        )
    log.exception("the engine raised", exc_info=exc)
    return ApiError(
        status=500, message=f"generation failed: {type(exc).__name__}", type=SERVER, code="engine_error"
    )


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_disconnected(work: Awaitable[T], disconnected: Awaitable[None]) -> T:
    """`work`'s result, or ClientGone (and `work` cancelled) when `disconnected` completes first."""
    working, watching = asyncio.ensure_future(work), asyncio.ensure_future(disconnected)
    try:
        await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (working, watching):
            task.cancel()
        await asyncio.gather(working, watching, return_exceptions=True)
    if working.cancelled():
        raise ClientGone()
    return working.result()


async def first_batch(batches: AsyncIterator[list[TextDelta]]) -> list[TextDelta]:
    """The first deltas (prefill's token): a stream's headers wait for them, so that a request refused
    (no room to wait, the engine at capacity) or failed before its first token gets a status, not a
    broken stream."""
    try:
        return await anext(batches)
    except StopAsyncIteration:
        return []
    except Exception as exc:  # no room to wait, the engine at capacity or failing: a status
        raise engine_error(exc) from None


async def sse_reply(
    plan: ReplyPlan, first: list[TextDelta], batches: AsyncIterator[list[TextDelta]]
) -> AsyncIterator[bytes]:
    """The stream: a chunk per batch of deltas, `finish_reason` on each choice's last, the usage chunk
    when asked, then `[DONE]`. Chat: a choice's role goes in a chunk of its own before its first text,
    so that a chunk never holds a choice twice. Closed early: `batches` is closed."""
    head, completion_tokens = plan.head, {job.index: 0 for job in plan.jobs}

    def encoded(batch: list[TextDelta]) -> bytes:
        roles, choices = [], []
        for delta in batch:
            completion_tokens[delta.index] = delta.completion_tokens
            ids = delta.token_ids if plan.show_token_ids else None
            reason = delta.finish_reason.value if delta.finish_reason else None
            if head.chat and delta.first:
                roles.append(responses.chunk_choice(head, delta.index, "", None, role=True))
                if not delta.text and reason is None:
                    continue
            choices.append(responses.chunk_choice(head, delta.index, delta.text, reason, token_ids=ids))
        role_chunk = sse_data(responses.chunk(head, roles)) if roles else b""
        return role_chunk + (sse_data(responses.chunk(head, choices)) if choices or not roles else b"")

    try:
        if first:
            yield encoded(first)
        async for batch in batches:
            yield encoded(batch)
        if plan.include_usage:
            yield sse_data(responses.usage_chunk(head, plan.prompt_tokens, sum(completion_tokens.values())))
    except Exception as exc:
        yield sse_data(engine_error(exc).body())
    finally:
        await batches.aclose()
    yield DONE


async def whole_reply(plan: ReplyPlan, batches: AsyncIterator[list[TextDelta]]) -> dict:
    """The whole answer once every choice has finished; an engine failure raises ApiError."""
    texts: dict[int, list[str]] = {job.index: [] for job in plan.jobs}
    ids: dict[int, list[int]] = {job.index: [] for job in plan.jobs}
    ends: dict[int, TextDelta] = {}
    try:
        async for batch in batches:
            for delta in batch:
                texts[delta.index].append(delta.text)
                ids[delta.index].extend(delta.token_ids)
                if delta.finish_reason is not None:
                    ends[delta.index] = delta
    except Exception as exc:
        raise engine_error(exc) from None
    finally:
        await batches.aclose()
    choices = [
        responses.choice_body(
            plan.head,
            i,
            "".join(texts[i]),
            ends[i].finish_reason.value,
            token_ids=ids[i] if plan.show_token_ids else None,
        )
        for i in sorted(texts)
    ]
    completion_tokens = sum(end.completion_tokens for end in ends.values())
    return responses.whole_response(plan.head, choices, plan.prompt_tokens, completion_tokens)
