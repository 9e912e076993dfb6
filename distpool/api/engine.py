"""What the HTTP front end asks of the engine behind it: one `Engine` protocol and the values it speaks.

The front end validates, tokenizes, detokenizes and streams; the engine only generates token ids:

    card = await engine.model_card()                     # once, when the front end starts serving
    async for event in engine.generate(rid, ids, args):  # a request, as its tokens are made
        ...                                              # event.token_ids, then finish_reason last
    await engine.abort(rid)                              # a stop string matched in the text
    await engine.health()                                # which workers answer

Cancellation is closing the iterator: a client that disconnects makes the front end cancel the task
that consumes `generate` (or `aclose()` it), so the engine's generator sees `CancelledError` or
`GeneratorExit` at its `await`/`yield` and must then free the request wherever it is (waiting,
prefilling, moving, decoding). `abort(request_id)` is the same cancellation asked for by id; after
either, no more events are read. Closing the iterator after the last event (the one with a
finish_reason) is not a cancellation: the request has ended and holds nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

from distpool.facts import Facts
from distpool.model.sampling import SamplingParams


class FinishReason(str, Enum):
    """Why a request ended, with OpenAI's words: an EOS or stop id or stop string (`stop`), its
    max_tokens or the context (`length`), or cancelled (`abort`: the client left, or aborted)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class ModelCard:
    """The served model, as the front end needs it. `tokenizer_folder`: the checkpoint folder holding
    its Hugging Face tokenizer (the front end loads it), None when it has none (token-id prompts only)."""

    served_name: str
    context_len: int  # prompt plus generated tokens, at most
    vocab_size: int  # token ids are in [0, vocab_size)
    eos_token_ids: tuple[int, ...] = ()
    tokenizer_folder: str | None = None

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer_folder is not None


# One request's generation parameters: the engine's own value (`distpool.model.sampling`), the one
# that prefill and decode carry, under the name the front end speaks. It checks its ranges when built;
# the front end has checked them first, to answer with OpenAI's error shape.
GenerationArgs = SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """Tokens of one request made since the last event (the first event: prefill's first token).
    The last event of a request has `finish_reason`; `stop_token_id` is the EOS or stop id that ended
    it (that id is in `token_ids`, and the front end leaves it out of the text)."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class WorkerHealth:
    """One worker as the engine last saw it: `name` is what /health reports (e.g. "prefill-0")."""

    name: str
    answers: bool
    detail: str = ""  # why not, when it does not answer


@dataclass(frozen=True)
class Health:
    workers: tuple[WorkerHealth, ...]

    @property
    def silent(self) -> tuple[WorkerHealth, ...]:
        return tuple(w for w in self.workers if not w.answers)

    @property
    def ok(self) -> bool:
        return not self.silent


class EngineBusy(Facts, Exception):
    """`generate` refuses a request for want of room before doing any work: the front end answers
    503 with Retry-After."""

    def __init__(self, retry_after_s: int = 1) -> None:
        super().__init__(f"the engine is at capacity; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class RequestFailed(Facts, Exception):
    """The engine could not finish a request (a worker lost, retries spent): `reason` says why, in the
    engine's words; the front end answers 500 (or an error event on a stream)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id, self.reason = request_id, reason


@runtime_checkable
class Engine(Protocol):
    """The engine behind the front end. Every method is async (`generate` an async generator), so a
    Ray Serve deployment or an actor adapts to it directly (`handle_engine.HandleEngine`); what
    crosses is these frozen values. Request ids are unique among requests in flight."""

    async def model_card(self) -> ModelCard: ...

    def generate(
        self, request_id: str, prompt_ids: tuple[int, ...], args: GenerationArgs
    ) -> AsyncIterator[TokenEvent]:
        """An async generator of the request's events; the last one carries `finish_reason`.
        Raises EngineBusy (before any event) or RequestFailed. Closed early: cancel the request."""
        ...

    async def abort(self, request_id: str) -> None:
        """Cancel the request (a stop string matched): free it wherever it is; a no-op once ended."""

    async def health(self) -> Health: ...
