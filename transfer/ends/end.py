"""What both ends of a channel share: the job record, the worker thread, staging, and the skeleton
every transfer concludes through.

    conclude(job, body):   run body on the copy stream
                           -> on failure: the typed TransferError; a broken channel's group is
                              destroyed before anything else (no posted receive outlives it)
                           -> synchronize the copy stream -> conclude the Transfer -> forget the
                              control messages it left unread
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from distpool.facts import Facts
from distpool.memory.envelope import Envelope
from transfer.ends.activity import Activity, ActivityLock
from transfer.ends.handle import ChunkHook, Transfer
from transfer.ends.staging import CopyStream, StagingBuffers
from transfer.pair import Channel
from transfer.plans import check_ranges
from transfer.wire import ArgInvalid, ChannelError, FailureKind, ProtocolError, TransferError, decode_message


@dataclass
class Job:
    """One transfer's inputs at one end (the engine's own record; `runs` is set once planned)."""

    transfer: Transfer
    envelope: Envelope  # its `moving` rows: the bytes it moves here, canonical order
    buffer: torch.Tensor  # the arena's 1-D uint8 buffer, on the channel's device
    ready: torch.cuda.Event | None = None  # CUDA: the caller's writes the gather must wait for
    runs: np.ndarray | None = None  # (m, 3) plan, once both tables are known
    offer: int = 0  # receiver: the serial of the OFFER it made for this destination (0: none)


class Stopped(Facts, Exception):
    """This transfer ends without success (refused, withdrawn, aborted); the channel is still in step.
    `cause`: the typed fact behind it, where there is one (a `HeaderRefused`)."""

    def __init__(self, kind: FailureKind, reason: str, *, cause: Exception | None = None) -> None:
        super().__init__(reason)
        self.kind, self.cause = kind, cause


def as_transfer_error(channel: Channel, request_id: str, exc: Exception) -> TransferError:
    """The TransferError a transfer concludes with after `exc`; anything unexpected breaks the channel."""
    if isinstance(exc, TransferError):
        return exc
    if isinstance(exc, Stopped):
        return TransferError(request_id, exc.kind, str(exc), cause=exc.cause)
    if isinstance(exc, ChannelError):
        kind, reason = exc.kind, str(exc)
    else:
        kind, reason = FailureKind.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    channel.mark_broken(reason)
    return TransferError(request_id, kind, reason, channel_broken=True)


class ChannelEnd(abc.ABC):
    """A channel end: its worker thread (started by `start()`), staging buffers, the copy stream, and
    the lock that orders a transfer against a reconnect (counted in `activity`, when given).
    Subclasses implement `run` and `drop_pending`."""

    role = ""

    def __init__(self, channel: Channel, rank: int, activity: Activity | None = None) -> None:
        if channel.rank != rank:
            raise ValueError(
                f"an {type(self).__name__} needs the rank-{rank} end of a channel, got rank {channel.rank}"
            )
        self.channel = channel
        self.staging = StagingBuffers(channel.device)
        self.stream = CopyStream(channel.device)
        self.cond = threading.Condition()
        # Held while a transfer, a reconnect or a link measurement uses the channel; counted in the
        # worker's `activity` (if any), which its model work waits on.
        self.io_lock = ActivityLock(activity)
        self.closed = False
        self._thread = threading.Thread(target=self.run, name=f"{self.role}-{channel.name}", daemon=True)

    def start(self) -> None:
        """Start the worker thread (once)."""
        if not self._thread.is_alive() and not self.closed:
            self._thread.start()

    def connect(self, timeout_s: float | None = None) -> None:
        """(Re)connect the channel (the peer must do the same); waits for a transfer in flight first."""
        with self.io_lock:
            self.channel.connect(timeout_s)
        with self.cond:
            self.cond.notify_all()

    def close(self, kind: FailureKind = FailureKind.ABORTED) -> None:
        """Fail what is pending (as `kind`: PEER_LOST when the peer went), tear the channel down and
        stop the worker."""
        with self.cond:
            self.closed = True
            pending = self.drop_pending()
            self.cond.notify_all()
        for job in pending:
            job.transfer.conclude(TransferError(job.transfer.request_id, kind, f"the {self.role} was closed"))
        with self.io_lock:
            self.channel.close()  # also wakes a worker waiting for the next control message
        if self._thread.is_alive():
            self._thread.join(timeout=self.channel.timeout_s)

    def new_job(
        self,
        envelope: Envelope,
        buffer: torch.Tensor,
        *,
        deadline_s: float,
        on_chunk: ChunkHook | None,
        on_expire: Callable[[Transfer], None],
        active_timeout_s: float | None = None,
        first_token: int | None = None,
    ) -> Job:
        """Check the caller's arguments (ValueError) and make the job and its transfer."""
        channel = self.channel
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            got = f"{tuple(buffer.shape)} {buffer.dtype}"
            raise ArgInvalid("the arena buffer", got, "a contiguous 1-D uint8 tensor")
        if buffer.device != channel.device and not (
            buffer.device.type == channel.device.type == "cuda" and channel.device.index is None
        ):
            raise ValueError(
                f"the buffer is on {buffer.device} but the channel was built for {channel.device}"
            )
        check_ranges(envelope.ranges, buffer.shape[0])
        # Only the rows a transfer moves are its to read or write: a held prefix is shared, read only.
        transfer = Transfer(
            request_id=envelope.request_id,
            role=self.role,
            num_bytes=envelope.num_bytes,
            deadline_s=deadline_s,
            on_chunk=on_chunk,
            on_expire=on_expire,
            active_timeout_s=active_timeout_s,
            first_token=first_token,
            held_pages=envelope.held_pages,
        )
        return Job(transfer=transfer, envelope=envelope, buffer=buffer, ready=self.stream.record())

    # ---- the skeleton every transfer concludes through ---------------------------------------------
    def conclude(
        self,
        request_id: str,
        job: Job | None,
        body: Callable[[], None],
        *,
        unread: list[str],
        on_broken: Callable[[TransferError], None] | None = None,
    ) -> None:
        """Run `body`; whatever happens, the transfer (if any) concludes exactly once, no posted
        send or receive outlives a broken channel's group, and the control messages named in
        `unread` are forgotten if they came."""
        channel, error = self.channel, None
        try:
            with self.stream.active():
                body()
        except Exception as exc:
            error = as_transfer_error(channel, request_id, exc)
            if error.channel_broken:
                # The peer hears why first (briefly: the link may be what failed), then the group
                # goes: before the copy stream is synchronized (after a timed-out NCCL wait it
                # would wait on the posted operation) and before the caller can free pages one
                # still targets.
                if on_broken is not None:
                    on_broken(error)
                channel.tear_down(error.reason)
        finally:
            self.stream.synchronize()
        if job is not None:
            job.transfer.conclude(error)
        if channel.healthy and unread:
            channel.control.discard(*unread)

    def read_message(
        self, blob: bytes, seq: int, *, expect: tuple[str, ...], max_bytes: int
    ) -> dict[str, Any]:
        """Decode a control message of transfer `seq` (ProtocolError when it is not one)."""
        message = decode_message(blob, expect=expect, max_bytes=max_bytes)
        if message["seq"] != seq:
            raise ProtocolError(f"{message['kind']} message is for transfer {message['seq']}, expected {seq}")
        return message

    def await_message(
        self, key: str, seq: int, *, expect: tuple[str, ...], timeout_s: float, max_bytes: int
    ) -> dict[str, Any] | None:
        """Wait for `key`, then read it as a message of transfer `seq`; None if it never came."""
        blob = self.channel.control.wait_value(key, timeout_s)
        return None if blob is None else self.read_message(blob, seq, expect=expect, max_bytes=max_bytes)

    @abc.abstractmethod
    def run(self) -> None:
        """The end's worker thread: moves queued transfers until closed."""

    @abc.abstractmethod
    def drop_pending(self) -> list[Job]:
        """Under the condition lock: remove and return the jobs not started yet."""
