"""A transfer as one end sees it (`Transfer`), and how the sender moves bytes (`TransferOptions`).

A `Transfer` is one envelope's move as one end sees it:

    WAITING --(header accepted)--> TRANSFERRING --> SUCCESS
       |                                |
       +--------------------------------+---------> FAILED (TransferError: request id + reason)

Every wait has a deadline, so each transfer reaches SUCCESS or FAILED by its deadline (plus the
time to tell the peer). Either end may `abort()`; the other end then fails too. Memory is the
caller's: whatever the outcome, it unpins and releases what it holds for the request, e.g.

    transfer = sender.submit(pool.envelope(rid), pool.buffer, first_token=t)
    try:
        transfer.wait()
    finally:
        pool.unpin(rid); pool.release(rid)
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from transfer.defaults import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_TIMEOUT_S,
    DIRECT_MIN_BYTES_CPU,
    DIRECT_MIN_BYTES_CUDA,
    MAX_CHUNK_BYTES,
    MAX_TIMEOUT_S,
    MIN_TIMEOUT_S,
)
from transfer.wire import FailureKind, TransferError


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


ChunkHook = Callable[["Transfer", int], None]
DoneCallback = Callable[["Transfer"], None]


@dataclass(frozen=True)
class TransferOptions:
    """How the sender moves bytes; the receiver takes them from the header (within its limits).

    `timeout_s`: the deadline of one transfer, and of connecting a channel. `chunk_bytes`: the
    pipelining unit and the staging buffer size (three buffers per sender and per receiver).
    `direct_min_bytes`: runs at least this long are sent straight from / into the arena (zero
    copy, one message each) instead of through a staging buffer, unless one staged batch of their
    chunk copies fewer bytes, counting each message as this many bytes copied
    (`transfer.plans.messages.plan_messages`); None picks the device's default (on Gloo a message costs
    about what copying 256 KiB does; on NCCL a GPU gathers at HBM speed). `checksum`: CRC-32 of
    the envelope's bytes on both ends, compared by the receiver.
    """

    timeout_s: float = DEFAULT_TIMEOUT_S
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    direct_min_bytes: int | None = None
    checksum: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s)) or not (
            MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S
        ):
            raise ValueError(
                f"the transfer timeout must be {MIN_TIMEOUT_S} to {MAX_TIMEOUT_S} s, got {self.timeout_s}"
            )
        if type(self.chunk_bytes) is not int or not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be in (0, 1 GiB], got {self.chunk_bytes}; 16-64 MiB suits most links"
            )
        if self.direct_min_bytes is not None and self.direct_min_bytes <= 0:
            raise ValueError(
                f"direct_min_bytes must be > 0 (or None for the device default), got {self.direct_min_bytes}"
            )

    def direct_min_bytes_for(self, device: torch.device) -> int:
        if self.direct_min_bytes is not None:
            return self.direct_min_bytes
        return DIRECT_MIN_BYTES_CUDA if device.type == "cuda" else DIRECT_MIN_BYTES_CPU


class Transfer:
    """One envelope transfer as seen by one end. Created by the engine; read `state`, `wait()`, `abort()`.

    `on_chunk(transfer, k)` (optional) runs on the engine's thread after chunk k is handed to the
    link (sender) or landed (receiver); tests and `--fault-rate` use it to inject faults.
    `on_expire(transfer)` is the engine's: it fails a transfer still waiting whose deadline passed
    or that was aborted. `active_timeout_s`, when set, replaces the deadline once the transfer
    begins (a receiver may wait long for a sender, then gives the bytes the usual timeout).
    `first_token` is the token prefill produced; it travels in the header to the receiver.
    """

    def __init__(
        self,
        *,
        request_id: str,
        role: str,
        num_bytes: int,
        deadline_s: float,
        on_chunk: ChunkHook | None = None,
        on_expire: Callable[[Transfer], None] | None = None,
        active_timeout_s: float | None = None,
        first_token: int | None = None,
        held_pages: int = 0,
    ) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.request_id = request_id
        self.role = role  # "sender" or "receiver"
        # The bytes it moves: the whole envelope, less the pages the destination holds already
        # (`held_pages`, known to the sender once the receiver answers).
        self.num_bytes = num_bytes
        self.held_pages = held_pages
        self.deadline = time.monotonic() + deadline_s  # time.monotonic() clock
        self.active_timeout_s = active_timeout_s
        self.first_token = first_token
        self.on_chunk = on_chunk
        self.num_chunks_done = 0
        self.began_at: float | None = None  # monotonic time of WAITING -> TRANSFERRING
        self.ended_at: float | None = None  # monotonic time it concluded
        self._state = TransferState.WAITING
        self._error: TransferError | None = None
        self._abort_reason: str | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._on_expire = on_expire
        self._callbacks: list[DoneCallback] | None = []  # None once concluded

    def __repr__(self) -> str:
        return f"Transfer({self.role} {self.request_id!r}, {self._state.value}, {self.num_bytes} bytes)"

    @property
    def state(self) -> TransferState:
        self.expire_if_due()
        return self._state

    @property
    def error(self) -> TransferError | None:
        return self._error

    @property
    def abort_reason(self) -> str | None:
        return self._abort_reason

    @property
    def active_s(self) -> float | None:
        """Seconds from the header's acceptance to the end: the time the bytes were moving (at a
        sender that planned on the receiver's offer, from its header on: it is not answered)."""
        if self.began_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.began_at

    def done(self) -> bool:
        return self.state in (TransferState.SUCCESS, TransferState.FAILED)

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Fail this transfer on both ends with `reason`.

        Not started yet: it fails at once. In flight: from the next chunk on, the sender stops
        gathering and the receiver stops scattering; the stream drains (so the channel stays in
        step and usable) and both ends conclude FAILED.
        """
        with self._lock:
            if self._abort_reason is None:
                self._abort_reason = reason
        if self._state is TransferState.WAITING and self._on_expire is not None:
            self._on_expire(self)  # not started yet: fail it now

    def unstarted_error(self, deadline_reason: str) -> TransferError:
        """Why a transfer the engine never started fails: its abort, if it was aborted; else its
        deadline (`deadline_reason` says which wait it was)."""
        if self._abort_reason is not None:
            return TransferError(self.request_id, FailureKind.ABORTED, self._abort_reason)
        return TransferError(self.request_id, FailureKind.TIMEOUT, deadline_reason)

    def wait(self, timeout_s: float | None = None) -> Transfer:
        """Block until the transfer concludes; return it on SUCCESS, raise its TransferError on FAILED.

        Raises TimeoutError only if `timeout_s` is given and passes first.
        """
        limit = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._done.is_set():
            until = self.deadline if limit is None else min(self.deadline, limit)
            if self._done.wait(max(until - time.monotonic(), 0.0) + 0.01):
                break
            self.expire_if_due()
            if limit is not None and time.monotonic() >= limit:
                raise TimeoutError(f"{self!r} still running after {timeout_s} s")
            if time.monotonic() >= self.deadline:
                # Past the deadline the engine is finishing its last (bounded) wait; poll gently.
                self._done.wait(0.05)
        if self._error is not None:
            raise self._error
        return self

    def add_done_callback(self, callback: DoneCallback) -> None:
        """Run `callback(transfer)` once it concludes, on the thread that concludes it (at once if
        it already has), before `wait()` returns. A callback must not block on the engine."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(callback)
                return
        callback(self)

    # ---- engine side -----------------------------------------------------------------------------
    def expire_if_due(self) -> None:
        if (
            self._state is TransferState.WAITING
            and self._on_expire is not None
            and time.monotonic() >= self.deadline
        ):
            self._on_expire(self)

    def begin(self) -> None:
        """WAITING -> TRANSFERRING (the header was accepted, or sent planned on an offer)."""
        with self._lock:
            if self._state is not TransferState.WAITING:
                raise RuntimeError(f"begin() on a transfer that is {self._state.value}")
            self._state = TransferState.TRANSFERRING
            self.began_at = time.monotonic()
            if self.active_timeout_s is not None:
                self.deadline = self.began_at + self.active_timeout_s

    def conclude(self, error: TransferError | None) -> bool:
        """Conclude once (later calls are ignored); returns whether this call concluded it. The done
        callbacks run before waiters wake: whoever waited sees what the callbacks did (e.g. the
        decode worker freeing a failed reservation)."""
        with self._lock:
            if self._callbacks is None:
                return False
            self._error = error
            self._state = TransferState.FAILED if error is not None else TransferState.SUCCESS
            self.ended_at = time.monotonic()
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks:
            callback(self)
        self._done.set()
        return True
