"""The decode worker: reserves destination envelopes, receives them, and decodes with continuous batching.

State contract (who owns which request, guarded by `_lock`):
- `_waiting`: reserved here, bytes not yet received; the destination envelope is pinned while a
  transfer writes into it.
- `_running`: received; in the decode batch; grows one token per step.
- `_finished`: tokens kept for the caller until `collect`; the pool holds nothing for them.
Admission keeps room for every admitted request to reach `prompt_len + max_new_tokens`, so a decode
step never runs out of pages.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from distpool.allocator import NeedsCompaction
from distpool.envelope import Envelope
from distpool.pool import DoesNotFit
from distpool.worker_base import WorkerBase
from transfer import TransferError


@dataclass
class _Request:
    prompt_len: int
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # generated so far (the first comes from prefill)
    admitted_at: float = 0.0
    finished_at: float = 0.0
    error: str | None = None


class DecodeWorker(WorkerBase):
    """Plain class; the launcher wraps it with `ray.remote`. Unit tests build it directly."""

    role = "decode"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._waiting: dict[str, _Request] = {}
        self._running: dict[str, _Request] = {}
        self._finished: dict[str, _Request] = {}
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self.num_steps = 0
        self._stepper = threading.Thread(target=self._decode_loop, name="decode-loop", daemon=True)
        self._stepper.start()

    # ---- admission --------------------------------------------------------------------------
    def _growth_tokens(self) -> int:
        """Tokens of pages that admitted requests may still claim (rounded to whole pages)."""
        pages_for = self.pool.allocator.pages_for
        pages = sum(
            pages_for(req.prompt_len + req.max_new_tokens) - pages_for(self.pool.num_tokens(rid))
            for rid, req in (*self._waiting.items(), *self._running.items())
        )
        return pages * self.pool.page_size

    def can_admit(self, prompt_len: int, max_new_tokens: int, *, after_compaction: bool = False) -> bool:
        """Whether a request fits together with the growth every admitted request may still claim."""
        with self._lock:
            if len(self._waiting) + len(self._running) >= self.plan.max_running_requests:
                return False
            tokens = prompt_len + max_new_tokens + self._growth_tokens()
            if after_compaction:
                return self.pool.can_reserve_after_compaction(tokens)
            return self.pool.can_reserve(tokens)

    def reserve(self, request_id: str, prompt_len: int, max_new_tokens: int) -> bytes:
        """Reserve the destination envelope for a prompt; returns the encoded Envelope.

        Raises DoesNotFit (holding nothing) when the request cannot be admitted with its headroom."""
        if prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(
                f"prompt_len and max_new_tokens must be >= 1; got {prompt_len}, {max_new_tokens}"
            )
        if prompt_len + max_new_tokens > self.plan.args.context_len:
            raise ValueError(
                f"request {request_id!r} needs {prompt_len + max_new_tokens} tokens, more than the pool's "
                f"context length {self.plan.args.context_len}; raise --context-len"
            )
        with self._lock:
            if request_id in self._waiting or request_id in self._running:
                raise ValueError(f"request {request_id!r} is already admitted on {self.name}")
            if not self.can_admit(prompt_len, max_new_tokens):
                if not self.can_admit(prompt_len, max_new_tokens, after_compaction=True):
                    raise DoesNotFit(
                        request_id, f"{self.name} has no room with headroom for running requests"
                    )
                self.pool.compact()
            self.pool.reserve(request_id, prompt_len)
            self._waiting[request_id] = _Request(prompt_len=prompt_len, max_new_tokens=max_new_tokens)
            self._note_peak()
            return self.pool.envelope(request_id).encode()

    def cancel(self, request_id: str) -> bool:
        """Free a reservation whose transfer will not happen. Returns whether anything was freed."""
        return self._free(self._waiting, request_id)

    # ---- transfer -----------------------------------------------------------------------------
    def receive(self, request_id: str, peer: str, first_token: int) -> dict:
        """Receive the whole envelope from `peer` into the reservation, then join the decode batch.

        On failure the reservation is freed and TransferError is raised."""
        envelope, ranges = self._pin_envelope(self._waiting, request_id)
        try:
            stats = self.channels.receive(peer, envelope, self.pool.arena, ranges)
        except BaseException:
            self._free(self._waiting, request_id, pinned=True)
            raise
        with self._lock:
            self.pool.unpin(request_id)
            req = self._waiting.pop(request_id)
            req.tokens.append(int(first_token))
            req.admitted_at = time.monotonic()
            if len(req.tokens) >= req.max_new_tokens:
                self._finish(request_id, req)
            else:
                self._running[request_id] = req
            self._wake.notify_all()
        return stats

    # ---- decode loop --------------------------------------------------------------------------
    def _finish(self, request_id: str, req: _Request) -> None:
        req.finished_at = time.monotonic()
        self.pool.release(request_id)
        self._finished[request_id] = req

    def _decode_loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                if not self._running:
                    self._wake.wait(timeout=0.5)
                    continue
                self.step_locked()
            time.sleep(0)  # between steps: let receives and reservations take the lock

    def step_locked(self) -> None:
        """One batched decode step over every running request (caller holds the lock)."""
        rids = list(self._running)
        self._extend_all(rids)
        next_tokens = self.model.decode_step(self.pool, rids, [self._running[r].tokens[-1] for r in rids])
        self.num_steps += 1
        for rid, token in zip(rids, next_tokens, strict=True):
            req = self._running[rid]
            req.tokens.append(int(token))
            if len(req.tokens) >= req.max_new_tokens:
                self._finish(rid, self._running.pop(rid))

    def _extend_all(self, rids: list[str]) -> None:
        batch = [(rid, 1) for rid in rids]
        try:
            self.pool.extend_batch(batch)
        except NeedsCompaction:
            self.pool.compact()  # admission kept the room; only fragmentation can be in the way
            self.pool.extend_batch(batch)
        self._note_peak()

    def poll(self, request_ids: list[str]) -> dict[str, list[int]]:
        """Tokens produced so far for admitted requests among `request_ids` (streaming; removes nothing)."""
        with self._lock:
            live = {**self._running, **self._finished}
            return {rid: list(live[rid].tokens) for rid in request_ids if rid in live}

    def collect(self, request_ids: list[str]) -> dict[str, dict]:
        """Finished requests among `request_ids` (removed from the worker): tokens and timings."""
        with self._lock:
            done = {rid: self._finished.pop(rid) for rid in request_ids if rid in self._finished}
        return {
            rid: {"tokens": r.tokens, "decode_s": r.finished_at - r.admitted_at} for rid, r in done.items()
        }

    def stats(self) -> dict:
        with self._lock:
            return {
                **super().stats(),
                "waiting": len(self._waiting),
                "running": len(self._running),
                "finished_uncollected": len(self._finished),
                "steps": self.num_steps,
            }

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        self._stepper.join(timeout=5)
        super().shutdown()


__all__ = ["DecodeWorker", "DoesNotFit", "Envelope", "TransferError"]
