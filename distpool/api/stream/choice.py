"""One choice of a request: the engine's token events turned into text deltas, stop strings matched.

The engine's iterator is closed whatever ends the choice (its last event, a stop string, the client
leaving, an error), which is the engine's signal to free the request wherever it is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from distpool.api.engine import Engine, FinishReason, GenerationArgs, RequestFailed
from distpool.api.stream.detokenize import IncrementalDetokenizer, StopMatcher


@dataclass(frozen=True)
class ChoiceJob:
    """What one choice generates from: its engine request id, prompt, and stopping rules."""

    index: int
    request_id: str
    prompt_ids: tuple[int, ...]
    args: GenerationArgs
    stop_strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """New text of one choice; the last delta has `finish_reason`. `token_ids`: the ids this delta
    consumed (the stop id included), `completion_tokens`: ids generated so far."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    completion_tokens: int
    finish_reason: FinishReason | None = None
    first: bool = False  # the delta of the engine's first event (prefill's token)


async def stream_choice(
    engine: Engine,
    job: ChoiceJob,
    decode: Callable[[list[int]], str] | None,
    on_first_event: Callable[[], None] = lambda: None,
) -> AsyncIterator[TextDelta]:
    """The choice's deltas as the engine's events arrive. `decode`: the tokenizer's decode, None for a
    model without one (deltas then carry ids only). Raises RequestFailed when the engine fails it."""
    detokenizer = IncrementalDetokenizer(decode, job.prompt_ids) if decode else None
    stops = StopMatcher(job.stop_strings)
    events = engine.generate(job.request_id, job.prompt_ids, job.args)
    count, first = 0, True
    held: tuple[int, ...] = ()  # ids of events whose text is not out yet: they go with the next delta
    try:
        async for event in events:
            if first:
                on_first_event()
            count += len(event.token_ids)
            ids = event.token_ids
            if event.stop_token_id is not None and ids and ids[-1] == event.stop_token_id:
                ids = ids[:-1]  # a stop id's text is not returned
            text = detokenizer.push(ids) if detokenizer else ""
            if event.is_last and detokenizer:
                text += detokenizer.flush()
            check = stops.push(text)
            token_ids, held = held + event.token_ids, ()
            if check.stopped:
                if not event.is_last:
                    await engine.abort(job.request_id)
                yield TextDelta(job.index, check.text, token_ids, count, FinishReason.STOP, first)
                return
            if event.is_last:
                yield TextDelta(
                    job.index, check.text + stops.flush(), token_ids, count, event.finish_reason, first
                )
                return
            if check.text or first or not detokenizer:
                yield TextDelta(job.index, check.text, token_ids, count, None, first)
            else:
                held = token_ids
            first = False
        raise RequestFailed(job.request_id, "the engine's events ended without a finish reason")
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
