"""Local prefill on a decode worker: a prompt that extends a finished request's tokens is prefilled
where that request decoded, from its kept final state (`distpool.memory.prefix.final_states`), with nothing
transferred. In a colocated deployment (`--prefill 0`) every request is prefilled where it decodes:
one that extends no kept state starts `fresh`, from nothing (a decode pool keeps no checkpoints at
page boundaries, so no cached prefix of it is usable without a kept state), in chunks alike.

    prompt   [0 .......... full pages) [ ... held) [held ...................... len(prompt))
    pages    the state's full pages,    own page:   own pages: computed here, `chunk_tokens` at a
             shared (read only)         its copy    time between two decode steps of the batch
    state    the kept state, copied into the request's own slot, continued chunk by chunk

Each chunk is one `model.prefill` job in place (`prefill_job.py`: its checkpoint is the request's own
slot), so the reference model, the synthetic cache and the transformers runner all run it. Once the
whole prompt is in, the request is handed on as if its envelope had just landed: admission verifies
it (synthetic cache) like a transferred one and it joins the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from decode.request import DecodeRequest
from distpool.memory.pool import DoesNotFit, Pool
from distpool.memory.prefix import StateKey
from distpool.model.sampling import SamplingParams, pick_for
from distpool.model_impl.pool_model import PoolModel
from distpool.model_impl.prefill_job import PrefillJob
from distpool.worker.config import WorkerConfigInvalid
from distpool.worker.messages import (
    LocalPrefillAnswer,
    LocalPrefillRefused,
    LocalPrefillStarted,
    Refusal,
    ViewedState,
)


class LocalPrefills:
    """The requests a decode worker prefills itself (guarded by the worker's lock)."""

    def __init__(
        self, pool: Pool, model: PoolModel, *, chunk_tokens: int, eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        if chunk_tokens < 1:
            raise WorkerConfigInvalid("local_prefill_chunk", chunk_tokens, "at least 1 token")
        self.pool, self.model, self.chunk_tokens = pool, model, chunk_tokens
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, DecodeRequest] = {}  # accepted, prompt not wholly computed yet, FIFO
        self.started = 0  # accepted so far

    def start(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        can_admit: Callable[[int, int, int], bool],
        *,
        fresh: bool = False,
        viewed: ViewedState | None = None,
    ) -> LocalPrefillAnswer:
        """Under the lock: reserve `request_id` on the kept state `prompt` extends, copy that state
        and its partial page in, and queue its chunks; or refuse, holding nothing. With no such state,
        `fresh` queues the whole prompt from nothing instead of refusing. `viewed`: the state the
        driver's view said this worker keeps (a refusal says whether its view was stale)."""
        cache = self.pool.prefix_cache
        states = cache.final_states if cache is not None else None
        entry = states.find(prompt) if states is not None else None
        if entry is None:
            if fresh:
                return self._start_fresh(request_id, prompt, params, can_admit)
            return LocalPrefillRefused(
                self._no_state(prompt, viewed),
                "no kept state that the prompt extends (evicted, or never here)",
            )
        match, max_new_tokens = entry.prefix_match(self.pool.page_size), params.max_tokens
        with cache.holding(match):  # making room may evict states, never these pages
            fits = can_admit(len(prompt), max_new_tokens, match.num_tokens)
        if not fits:
            return LocalPrefillRefused(Refusal.NO_ROOM, "no room with headroom for running requests")
        if states.find(prompt) is not entry:  # making room evicted it
            return LocalPrefillRefused(Refusal.EVICTED, "its kept state was evicted to make room")
        first_stop = min(len(prompt), entry.num_tokens + self.chunk_tokens)
        final = len(prompt) + max_new_tokens
        try:
            self.pool.reserve(request_id, first_stop, compact=True, final_tokens=final, prefix=match)
        except DoesNotFit as exc:  # holds nothing
            return LocalPrefillRefused(Refusal.NO_ROOM, f"no room: {exc.reason}")
        copying = time.monotonic()
        try:
            states.restore(entry, request_id)
        except BaseException:
            self.pool.release(request_id)
            raise
        copy_s = time.monotonic() - copying  # under the lock: the batch waits for it, as for a chunk
        self._queue(request_id, prompt, params, entry.num_tokens, accepted_at=copying, compute_s=copy_s)
        return LocalPrefillStarted(held_tokens=entry.num_tokens)

    def _no_state(self, prompt: Sequence[int], viewed: ViewedState | None) -> Refusal:
        """Whether the driver had heard that the state it chose this worker for is gone."""
        journal = self.pool.prefix_cache.journal if self.pool.prefix_cache is not None else None
        if viewed is None or journal is None:
            return Refusal.NO_STATE
        state = StateKey.of(prompt[: viewed.held_tokens], self.pool.page_size)
        return Refusal.NO_STATE if journal.drop_reported(state, viewed.report) else Refusal.NEWS_IN_FLIGHT

    def _start_fresh(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        can_admit: Callable[[int, int, int], bool],
    ) -> LocalPrefillAnswer:
        """Under the lock: reserve `request_id` for its first chunk, with room kept for all of it,
        and queue its chunks from token 0; or refuse, holding nothing."""
        accepted = time.monotonic()
        if not can_admit(len(prompt), params.max_tokens, 0):
            return LocalPrefillRefused(Refusal.NO_ROOM, "no room with headroom for running requests")
        first_stop, final = min(len(prompt), self.chunk_tokens), len(prompt) + params.max_tokens
        try:
            self.pool.reserve(request_id, first_stop, compact=True, final_tokens=final)
        except DoesNotFit as exc:  # holds nothing
            return LocalPrefillRefused(Refusal.NO_ROOM, f"no room: {exc.reason}")
        self._queue(request_id, prompt, params, 0, accepted_at=accepted, compute_s=0.0)
        return LocalPrefillStarted(held_tokens=0)

    def _queue(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        held_tokens: int,
        *,
        accepted_at: float,
        compute_s: float,
    ) -> None:
        self.requests[request_id] = DecodeRequest(
            prompt=list(prompt),
            params=params,
            held_tokens=held_tokens,
            local=True,
            prefilled=held_tokens,
            accepted_at=accepted_at,
            compute_s=compute_s,
        )
        self.started += 1

    def advance(self) -> tuple[str, DecodeRequest] | None:
        """Under the lock: compute the next chunk of the oldest request; returns it (its first token
        appended, the model's record of it dropped for admission) once its whole prompt is in."""
        if not self.requests:
            return None
        rid, req = next(iter(self.requests.items()))
        stop = min(req.prompt_len, req.prefilled + self.chunk_tokens)
        if (more := stop - self.pool.num_tokens(rid)) > 0:
            self.pool.extend(rid, more, compact=True)  # admission kept the room
        started, slot = time.monotonic(), self.pool.slot_id(rid)
        # The last chunk picks the first token, as a prefill worker would (the same draw).
        pick = pick_for(req.params, self.eos_token_ids, 0) if stop == req.prompt_len else None
        job = PrefillJob(
            rid, req.prompt[:stop], cached=req.prefilled, checkpoint_slot=slot, pick=pick
        )  # in place
        (done,) = self.model.prefill(self.pool, [job])
        req.prefilled = stop
        req.compute_s += time.monotonic() - started
        if stop < req.prompt_len:
            return None
        del self.requests[rid]
        self.model.forget(rid)  # admission registers it again, from the bytes it verifies
        req.tokens.append(done.first_token)
        req.landed_at = time.monotonic()
        return rid, req
