"""The per-transfer handle and the pieces both ends of a channel share.

A `Transfer` is one envelope's move as one end sees it:

    WAITING --(header accepted)--> TRANSFERRING --> SUCCESS
       |                                |
       +--------------------------------+---------> FAILED (TransferError: request id + reason)

Every wait has a deadline, so each transfer reaches SUCCESS or FAILED by its deadline (plus the
time to tell the peer). Either end may `abort()`; the other end then fails too. Memory is the
caller's: whatever the outcome, it unpins and releases what it holds for the request, e.g.

    transfer = sender.submit(envelope, pool.arena, pool.envelope_ranges(rid), deadline_s=10)
    try:
        transfer.wait()
    finally:
        pool.unpin(rid); pool.release(rid)
"""

from __future__ import annotations

import abc
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from distpool.envelope import Envelope
from transfer.channel import Channel
from transfer.errors import ChannelError, TransferError
from transfer.plan import check_ranges
from transfer.staging import CopyStream, StagingBuffers


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


ChunkHook = Callable[["Transfer", int], None]

# Default zero-copy thresholds (see TransferOptions). Only runs this long travel as their own
# message, so an envelope of scattered pages still goes as a few staged chunks, never one message
# per page. On this class of 2-core CPU machine a 256 KiB threshold measured ~15% faster for
# fully scattered 384 KiB pages (scripts/bench_transfer.py --direct-min-kib), at the price of one
# message per page; the design's "few large messages" wins.
DIRECT_MIN_BYTES_CPU = 4 << 20
DIRECT_MIN_BYTES_CUDA = 16 << 20


@dataclass(frozen=True)
class TransferOptions:
    """How the sender moves bytes; the receiver takes them from the header (within its limits).

    `chunk_bytes`: the pipelining unit and the staging buffer size (three buffers per sender and
    per receiver). `direct_min_bytes`: runs at least this long are sent straight from / into the
    arena (zero copy, one message each) instead of through a staging buffer; None picks the
    device's default (a message costs ~20 us of CPU on Gloo, ~10 us of launch on NCCL, while a
    GPU gathers at HBM speed). `checksum`: CRC-32 of the envelope's bytes on both ends, compared
    by the receiver.
    """

    chunk_bytes: int = 32 << 20
    direct_min_bytes: int | None = None
    checksum: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= 1 << 30:
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
    """

    def __init__(
        self,
        *,
        request_id: str,
        role: str,
        num_bytes: int,
        deadline_s: float,
        on_chunk: ChunkHook | None = None,
    ) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.request_id = request_id
        self.role = role  # "sender" or "receiver"
        self.num_bytes = num_bytes
        self.deadline = time.monotonic() + deadline_s  # time.monotonic() clock
        self.on_chunk = on_chunk
        self.num_chunks_done = 0
        self.began_at: float | None = None  # monotonic time of WAITING -> TRANSFERRING
        self.ended_at: float | None = None  # monotonic time it concluded
        self._state = TransferState.WAITING
        self._error: TransferError | None = None
        self._abort_reason: str | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._expire: Callable[[Transfer], None] | None = None  # set by a receiver for WAITING expiry

    def __repr__(self) -> str:
        return f"Transfer({self.role} {self.request_id!r}, {self._state.value}, {self.num_bytes} bytes)"

    @property
    def state(self) -> TransferState:
        self._expire_if_due()
        return self._state

    @property
    def error(self) -> TransferError | None:
        return self._error

    @property
    def abort_reason(self) -> str | None:
        return self._abort_reason

    @property
    def active_s(self) -> float | None:
        """Seconds from the header's acceptance to the end: the time the bytes were moving."""
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
        if self._state is TransferState.WAITING and self._expire is not None:
            self._expire(self)  # not started yet: fail it now

    def wait(self, timeout_s: float | None = None) -> Transfer:
        """Block until the transfer concludes; return it on SUCCESS, raise its TransferError on FAILED.

        Raises TimeoutError only if `timeout_s` is given and passes first.
        """
        limit = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._done.is_set():
            until = self.deadline if limit is None else min(self.deadline, limit)
            if self._done.wait(max(until - time.monotonic(), 0.0) + 0.01):
                break
            self._expire_if_due()
            if limit is not None and time.monotonic() >= limit:
                raise TimeoutError(f"{self!r} still running after {timeout_s} s")
            if time.monotonic() >= self.deadline:
                # Past the deadline the engine is finishing its last (bounded) wait; poll gently.
                self._done.wait(0.05)
        if self._error is not None:
            raise self._error
        return self

    # ---- engine side -----------------------------------------------------------------------------
    def _expire_if_due(self) -> None:
        if (
            self._state is TransferState.WAITING
            and self._expire is not None
            and time.monotonic() >= self.deadline
        ):
            self._expire(self)

    def _begin(self) -> None:
        with self._lock:
            assert self._state is TransferState.WAITING, self._state
            self._state = TransferState.TRANSFERRING
            self.began_at = time.monotonic()

    def _finish(self, error: TransferError | None) -> bool:
        """Conclude once (later calls are ignored); returns whether this call concluded it."""
        with self._lock:
            if self._done.is_set():
                return False
            self._error = error
            self._state = TransferState.FAILED if error is not None else TransferState.SUCCESS
            self.ended_at = time.monotonic()
            self._done.set()
            return True


@dataclass
class Job:
    """One transfer's inputs at one end (the engine's own record; `runs` is set once planned)."""

    transfer: Transfer
    envelope: Envelope
    arena: torch.Tensor  # 1-D uint8, on the channel's device
    ranges: torch.Tensor  # (n, 2) int64 on the host: this end's bytes, canonical order
    ready: torch.cuda.Event | None = None  # CUDA: the caller's writes the gather must wait for
    runs: np.ndarray | None = None  # (m, 3) plan, once both tables are known
    spent_keys: list[str] = field(default_factory=list)  # store keys to delete once it concluded


class ChannelEnd(abc.ABC):
    """What both engines share: a channel, a worker thread, staging, and the lock that orders a
    transfer against a rebuild. Subclasses implement `_run` (the worker) and `_drop_pending`."""

    role = ""

    def __init__(self, channel: Channel, rank: int) -> None:
        if channel.rank != rank:
            raise ValueError(
                f"an {type(self).__name__} needs the rank-{rank} end of a channel, got rank {channel.rank}"
            )
        self.channel = channel
        self._staging = StagingBuffers(channel.device)
        self._stream = CopyStream(channel.device)
        self._cond = threading.Condition()
        self._io_lock = threading.Lock()  # held while a transfer or a rebuild uses the channel
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"{self.role}-{channel.name}", daemon=True)
        self._thread.start()

    def connect(self, timeout_s: float | None = None) -> None:
        """(Re)connect the channel (the peer must do the same); waits for a transfer in flight first."""
        with self._io_lock:
            self.channel.connect(timeout_s)
        with self._cond:
            self._cond.notify_all()

    rebuild = connect

    def close(self) -> None:
        """Fail what is pending, tear the channel down and stop the worker."""
        with self._cond:
            self._closed = True
            pending = self._drop_pending()
            self._cond.notify_all()
        for job in pending:
            job.transfer._finish(TransferError(job.transfer.request_id, f"the {self.role} was closed"))
        with self._io_lock:
            self.channel.close()  # also wakes a worker blocked on the store
        self._thread.join(timeout=self.channel.timeout_s)

    def _new_job(
        self,
        envelope: Envelope,
        arena: torch.Tensor,
        ranges: torch.Tensor,
        deadline_s: float,
        on_chunk: ChunkHook | None,
    ) -> Job:
        """Check the caller's arguments (ValueError) and make the job and its transfer."""
        channel = self.channel
        if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
            raise ValueError(
                f"arena must be a contiguous 1-D uint8 tensor, got {tuple(arena.shape)} {arena.dtype}"
            )
        if arena.device != channel.device and not (
            arena.device.type == channel.device.type == "cuda" and channel.device.index is None
        ):
            raise ValueError(f"arena is on {arena.device} but the channel was built for {channel.device}")
        if ranges.device.type != "cpu":
            raise ValueError("ranges must be a CPU tensor (the plan is computed on the host)")
        check_ranges(ranges, arena.shape[0])
        total = int(ranges[:, 1].sum())
        if total != envelope.num_bytes:
            raise ValueError(
                f"ranges cover {total} bytes but envelope {envelope.request_id!r} says {envelope.num_bytes}"
            )
        transfer = Transfer(
            request_id=envelope.request_id,
            role=self.role,
            num_bytes=envelope.num_bytes,
            deadline_s=deadline_s,
            on_chunk=on_chunk,
        )
        return Job(
            transfer=transfer,
            envelope=envelope,
            arena=arena,
            ranges=ranges.clone(),
            ready=self._stream.record(),
        )

    @abc.abstractmethod
    def _run(self) -> None:
        """The end's worker thread: moves queued transfers until closed."""

    @abc.abstractmethod
    def _drop_pending(self) -> list[Job]:
        """Under the condition lock: remove and return the jobs not started yet."""


class Stopped(Exception):
    """Internal: this transfer ends without success (refused, withdrawn, aborted); the channel is
    still in step."""


def as_transfer_error(channel: Channel, request_id: str, exc: Exception) -> TransferError:
    """The TransferError a transfer concludes with after `exc`; anything unexpected breaks the channel."""
    if isinstance(exc, TransferError):
        return exc
    if isinstance(exc, Stopped):
        return TransferError(request_id, str(exc))
    reason = fail_reason(exc)
    channel.mark_broken(reason)
    return TransferError(request_id, reason, channel_broken=True)


def fail_reason(exc: BaseException) -> str:
    """The reason text for a transfer that failed on an exception (the channel goes down with it)."""
    if isinstance(exc, ChannelError):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"
