"""The decode worker: reserves destination envelopes, receives them, and decodes with continuous batching.

State contract (who owns which request, guarded by `lock`):
- `waiting`: reserved here and expected from one prefill worker; the destination envelope is pinned
  until its transfer concludes (its completion moves it on, or frees it).
- `prefilling`: prefilled here from a kept final state, or from nothing (colocated; local_prefill.py),
  one chunk between two decode steps; once its prompt is in, it moves to `arrived` as if its
  envelope had landed.
- `arrived`: received, not yet verified; the decode loop verifies every byte (a synthetic cache)
  before the request joins the batch, and fails it as corrupt on a mismatch.
- `running`: verified; in the decode batch; grows one token per step. Before release the whole
  envelope is verified again (compaction or a neighbour's write could have damaged it).
- `outbox.finished`: tokens kept for the caller until `next_events` hands them out (`outbox.py`,
  with the tokens made since the last hand-out and the cache's news); the pool holds nothing for
  them but what its prefix cache kept: their full pages, and their final state with their partial
  page (`final_states.py`), which a next turn continues from.
Prefix reuse: a request whose prompt starts with cached pages (an earlier turn that finished here)
reserves them by reference; its transfer moves only the rest and the state slot. What the cache
cached and evicted goes to the driver with the next results (`DecodeEvents.cache`), at once when
nothing else is due: the driver's view of this cache is this cache's keys (`cache_keys`).
Admission keeps room for every admitted request to reach `prompt_len + max_new_tokens`, so a decode
step never runs out of pages. A request's way from `waiting` into the batch is `arrivals.py`'s, the
ways it ends (finished, corrupt, given back or up, the loop failed) are `endings.py`'s.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import asdict

from decode.arrivals import Arrivals
from decode.endings import Endings
from decode.local_prefill import LocalPrefills
from decode.loop import DecodeLoop
from decode.outbox import Outbox
from decode.request import DecodeRequest, check_request
from distpool.memory.pool import DoesNotFit
from distpool.memory.prefix import CacheKeys
from distpool.model.sampling import SamplingParams, finish_after, pick_for
from distpool.worker.base import WorkerBase, byte_runs
from distpool.worker.messages import DecodeEvents, DecodeResult, LocalPrefillAnswer, ViewedState
from distpool.worker.stats import DecodeStats
from transfer import FailureKind, Parts, TransferError


class DecodeWorker(WorkerBase):
    """Plain class; the launcher wraps it with `ray.remote`. Unit tests build it directly."""

    role = "decode"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.waiting: dict[str, DecodeRequest] = {}
        self.arrived: dict[str, DecodeRequest] = {}
        self.running: dict[str, DecodeRequest] = {}
        self.eos_token_ids = self.config.eos_token_ids  # end a request once its min_tokens are made
        self.local = LocalPrefills(
            self.pool,
            self.model,
            chunk_tokens=self.config.local_prefill_chunk,
            eos_token_ids=self.eos_token_ids,
        )
        self.prefilling = self.local.requests
        self.wake = threading.Condition(self.lock)  # an arrival, a finished request, or shutdown
        self.num_steps = 0
        self.loop = DecodeLoop(self)
        self.outbox = Outbox(
            self.wake,
            self.pool.prefix_cache,
            self.eos_token_ids,
            streaming=lambda: (*self.waiting.items(), *self.arrived.items(), *self.running.items()),
            waiting=lambda: bool(self.waiting),
            stopping=lambda: self.loop.stopping,
        )
        self.endings = Endings(self, self._free)
        self.arrivals = Arrivals(self, self.endings, self._free)
        self.loop.start()

    # ---- admission --------------------------------------------------------------------------
    def _growth_tokens(self) -> int:
        """Tokens of pages that admitted requests may still claim (rounded to whole pages)."""
        pages_for = self.pool.pages_for
        pages = sum(
            pages_for(req.prompt_len + req.max_new_tokens) - pages_for(self.pool.num_tokens(rid))
            for rid, req in self._admitted()
        )
        return pages * self.pool.page_size

    def can_admit(self, prompt_len: int, max_new_tokens: int, held_tokens: int = 0) -> bool:
        """Whether a request fits (compacting if need be, evicting idle cached prefixes) beside the
        growth every admitted request may still claim; `held_tokens` of its prompt are in cached
        pages it will share."""
        with self.lock:
            if sum(1 for _ in self._admitted()) >= self.sizes.max_running_requests:
                return False
            need = prompt_len + max_new_tokens + self._growth_tokens() - held_tokens
            return self.pool.make_room(need, compact=True)

    def _admitted(self):
        """(request id, request) of every request holding memory here."""
        return (
            *self.waiting.items(),
            *self.prefilling.items(),
            *self.arrived.items(),
            *self.running.items(),
        )

    def reserve(self, request_id: str, prompt: list[int], params: SamplingParams, prefill: str) -> None:
        """Reserve the destination envelope for `prompt` and expect it from worker `prefill`. The
        envelope stays here: the request joins the decode batch when its transfer lands (the
        transfer header carries its first token), and is freed if the transfer fails. `params` (its
        seed set) say how decode picks its tokens and when it ends.


        Raises DoesNotFit (holding nothing) when the request cannot be admitted with its headroom."""
        check_request(request_id, prompt, params, self.model.vocab_size, self.sizes.args.context_len)
        prompt_len, max_new_tokens = len(prompt), params.max_tokens
        with self.lock:
            self._check_new(request_id)
            cache = self.pool.prefix_cache
            match = cache.match(prompt) if cache is not None else None
            held_pages = len(match.pages) if match is not None else 0
            with cache.holding(match) if match is not None else nullcontext():  # eviction spares it
                if not self.can_admit(prompt_len, max_new_tokens, held_pages * self.pool.page_size):
                    reason = f"{self.name} has no room with headroom for running requests"
                    # Its prefill may be computing already: its header is refused when it comes.
                    refusal = f"reservation refused: {reason}"
                    for peer in self.peer_ranks(prefill):
                        self.channels.refuse(request_id, FailureKind.NO_ROOM, refusal, peer=peer)
                    self._news_out()
                    raise DoesNotFit(request_id, reason)
                # Its final length keeps room for the tokens it will generate right after its pages.
                final = prompt_len + max_new_tokens
                self.pool.reserve(request_id, prompt_len, compact=True, final_tokens=final, prefix=match)
            self.pool.pin(request_id)  # a transfer writes into it from now on
            req = self.waiting[request_id] = DecodeRequest(
                prompt=prompt, params=params, held_tokens=held_pages * self.pool.page_size
            )
            self._note_peak()
            self._news_out()
        try:  # whatever fails from here on gives back what the reservation took
            # The cached prefix's pages are shared: the transfer moves (and writes) only the rest.
            envelope = self.pool.envelope(request_id, held_pages=held_pages)
            req.runs = byte_runs(envelope.moving)
            # One transfer per channel from the prefill worker's ranks this rank's shard needs.
            for peer in self.peer_ranks(prefill):
                req.transfers.append(self.channels.expect(peer, envelope, self.pool.buffer))
            req.parts = Parts(req.transfers)  # one failing aborts the others
        except BaseException:
            for transfer in req.transfers:  # expected, never started: they fail at once
                transfer.abort("the reservation failed")
            self._free(self.waiting, request_id, pinned=True)
            raise
        req.parts.add_done_callback(self._landed)

    def _news_out(self) -> None:
        """Under the lock: making room evicted cached entries: `next_events` tells the driver now."""
        if self.outbox.news_of_cache():
            self.wake.notify_all()

    def _check_new(self, request_id: str) -> None:
        if any(request_id == rid for rid, _ in self._admitted()):
            raise ValueError(f"request {request_id!r} is already admitted on {self.name}")

    def local_prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        fresh: bool = False,
        viewed: ViewedState | None = None,
    ) -> LocalPrefillAnswer:
        """Prefill `prompt` here, from the kept final state of a finished request it extends, with no
        transfer (local_prefill.py); or refuse, holding nothing (no such state here, or no room).
        `fresh` (a colocated deployment): with no such state, prefill the whole prompt here.
        `viewed`: the state the driver's view of this cache said is here (its refusal says whether
        that view was stale or this cache's news was on its way)."""
        check_request(request_id, prompt, params, self.model.vocab_size, self.sizes.args.context_len)
        with self.lock:
            self._check_new(request_id)
            answer = self.local.start(request_id, prompt, params, self.can_admit, fresh=fresh, viewed=viewed)
            self._note_peak()
            self.wake.notify_all()
            return answer

    def _landed(self, parts: Parts) -> None:
        """Every transfer of a waiting request concluded (on the engine's thread; a failure aborted
        the others first, so nothing still writes into it): hand it to the decode loop, which
        verifies it, or free it."""
        rid = parts.request_id
        with self.lock:
            req = self.waiting.get(rid)
            if req is not None and req.parts is parts:
                self.arrivals.landed(rid, req, parts)

    def cancel(self, request_id: str, *, notify: bool = False) -> bool:
        """Give the request up here, wherever it is: a waiting reservation's transfer is aborted, a
        running request leaves the batch (its transfer succeeded but the driver never heard so), a
        finished one is forgotten; its memory is freed. With `notify`, a request already admitted
        is handed out by `next_finished` as failed, so a driver waiting for it hears. Returns whether
        this worker held it."""
        # With `notify` its prefill may still be on its way: the header is refused when it comes.
        # Without, the driver is done with this attempt: no refusal is left for the next one.
        if notify:
            self.channels.refuse(request_id, FailureKind.ABORTED, "cancelled: the request was given up here")
        else:
            self.channels.refuse(request_id, None)
        with self.lock:
            if self.endings.give_up(request_id, notify=notify):
                return True
            req = self.waiting.get(request_id)
        if req is None or req.parts is None:
            return False
        req.parts.abort("cancelled: the request failed elsewhere")
        try:  # a waiting transfer concludes at once, a running one within its deadline
            req.parts.wait()
        except TransferError:
            return True  # the expected outcome: `_landed` freed the reservation
        with self.lock:  # the abort came after the last byte landed: the transfer admitted it
            self.endings.give_up(request_id, notify=notify)
        return True

    # ---- decode loop --------------------------------------------------------------------------
    def _group_formed(self) -> None:
        self.wake.notify_all()  # the lockstep loop starts stepping

    def fail_loop_requests(self, exc: Exception) -> None:
        """Under the lock: the decode loop raised; every request it holds fails with the reason, is
        handed out by `next_finished`, and gives its memory back."""
        self.endings.fail_all(exc)
        self.loop.failed()
        self.wake.notify_all()

    def step_locked(self, rids: list[str] | None = None) -> None:
        """One batched decode step over running requests `rids` (None: all of them); the caller
        holds the lock."""
        rids = list(self.running) if rids is None else rids
        self._extend_all(rids)
        reqs = [self.running[r] for r in rids]
        picks = [pick_for(req.params, self.eos_token_ids, len(req.tokens)) for req in reqs]
        next_tokens = self.model.decode_step(self.pool, rids, [req.tokens[-1] for req in reqs], picks)
        self.num_steps += 1
        for rid, req, token in zip(rids, reqs, next_tokens, strict=True):
            req.tokens.append(int(token))
            # An EOS or stop id, or max_tokens: it ends here, and its memory goes back at once.
            req.finish = finish_after(req.params, self.eos_token_ids, req.tokens)
            if req.finish is not None:
                self.endings.finish(rid, self.running.pop(rid))
        self.wake.notify_all()  # a streaming `next_events` hands the new tokens out

    def _extend_all(self, rids: list[str]) -> None:
        # Admission kept the room; only fragmentation can be in the way, and compaction clears it.
        self.pool.extend_batch([(rid, 1) for rid in rids], compact=True)
        self._note_peak()

    def progress(self, request_ids: list[str]) -> dict[str, int]:
        """For each of `request_ids` held here, a count that grows as it is served: prompt tokens
        prefilled here and tokens generated (what the driver's deadline on its result watches)."""
        wanted = set(request_ids)
        with self.lock:
            held = (*self._admitted(), *self.outbox.finished.items())
            return {rid: req.prefilled + len(req.tokens) for rid, req in held if rid in wanted}

    def next_finished(self, timeout_s: float = 1.0) -> dict[str, DecodeResult]:
        """`next_events` without streaming: the requests that ended, each handed out once (and the
        cache's news taken with them dropped: a driver keeping a view of this cache reads
        `next_events`)."""
        return self.next_events(timeout_s).finished

    def next_events(self, timeout_s: float = 1.0, stream: bool = False) -> DecodeEvents:
        """Wait up to `timeout_s` for news: requests that ended (each handed out once), what the
        prefix cache cached and evicted, and with `stream` the tokens made since the last call
        (`outbox.Outbox.next_events`). The driver keeps one such call outstanding."""
        return self.outbox.next_events(timeout_s, stream)

    def cache_keys(self) -> CacheKeys:
        """Every key this worker's prefix cache holds now (what the driver's view should equal)."""
        with self.lock:
            cache = self.pool.prefix_cache
            return cache.keys() if cache is not None else CacheKeys()

    def stats(self) -> DecodeStats:
        with self.lock:
            return DecodeStats(
                **asdict(super().stats()),
                waiting=len(self.waiting),
                prefilling=len(self.prefilling),
                local_prefills=self.local.started,
                decode_state_checkpoints=self._final_states_kept(),
                arrived=len(self.arrived),
                running=len(self.running),
                verified_envelopes=self.arrivals.verified,
                corrupt_envelopes=self.endings.corrupt,
                finished_uncollected=len(self.outbox.finished),
                steps=self.num_steps,
            )

    def _final_states_kept(self) -> int:
        cache = self.pool.prefix_cache
        return cache.final_states.kept if cache is not None and cache.final_states is not None else 0

    def shutdown(self) -> None:
        self.loop.stop()
        super().shutdown()
