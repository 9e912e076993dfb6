"""One request's transfers on every channel of one rank: landed when every part has.

Across TP sizes, destination rank d receives its shard of a request from each source rank
`transfer.plans.reshard.source_ranks` names, one channel each, and source rank s sends to each
destination rank it serves. Every channel moves its own part and concludes its own `Transfer`;
`Parts` joins one rank's parts of one request:

    parts = expect_parts(receivers, pool.envelope(rid), pool.buffer)   # decode rank: one per channel
    parts = submit_parts(senders, pool.envelope(rid), pool.buffer, first_token=t)   # prefill rank
    try:
        parts.wait()            # landed on this rank: every part arrived (or raises TransferError)
    finally:
        pool.unpin(rid) ...     # every part has concluded by now: no channel still writes there

A part that fails aborts the others (they would only fill a reservation that is given up), and
`wait` raises the first failure's `TransferError` once every part has concluded, so the caller may
release the request's memory at once. With one channel (equal TP), `Parts` is that one transfer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from distpool.memory.envelope import Envelope
from transfer.ends import EnvelopeReceiver, EnvelopeSender, Transfer
from transfer.wire import TransferError

PartsCallback = Callable[["Parts"], None]


class Parts:
    """One request's transfers on one rank's channels (one per channel, in the channels' order)."""

    def __init__(self, transfers: Sequence[Transfer]) -> None:
        if not transfers:
            raise ValueError("a request moves over at least one channel: give one transfer per channel")
        if len({t.request_id for t in transfers}) != 1:
            raise ValueError("the parts of one request share its request id")
        self.transfers = tuple(transfers)
        self.request_id = transfers[0].request_id
        self._lock = threading.Lock()
        self._left = len(transfers)
        self._error: TransferError | None = None
        self._done = threading.Event()
        self._callbacks: list[PartsCallback] | None = []  # None once every part concluded
        for transfer in self.transfers:
            transfer.add_done_callback(self._part_done)

    def __repr__(self) -> str:
        return f"Parts({self.request_id!r}, {len(self.transfers)} channels, {self._left} moving)"

    @property
    def error(self) -> TransferError | None:
        """The first part's failure, once every part has concluded (None: landed)."""
        return self._error if self._done.is_set() else None

    @property
    def num_bytes(self) -> int:
        """The bytes the parts move together: the rank's shard of the envelope."""
        return sum(t.num_bytes for t in self.transfers)

    def done(self) -> bool:
        return self._done.is_set()

    def abort(self, reason: str = "aborted by the caller") -> None:
        for transfer in self.transfers:
            transfer.abort(reason)

    def wait(self, timeout_s: float | None = None) -> Parts:
        """Block until every part concludes; return on success, else raise the first failure.

        Raises TimeoutError only if `timeout_s` is given and passes first (each part still
        concludes by its own deadline)."""
        limit = None if timeout_s is None else time.monotonic() + timeout_s
        for transfer in self.transfers:  # each part's wait also expires a part whose deadline passed
            try:
                transfer.wait(None if limit is None else max(limit - time.monotonic(), 0.0))
            except TransferError:
                pass  # the first failure is raised below, once every part has concluded
        # Every part concluded: their callbacks, ours among them, ran before their waits returned.
        if not self._done.is_set():
            raise RuntimeError(f"{self}: every part concluded, the whole did not")
        if self._error is not None:
            raise self._error
        return self

    def add_done_callback(self, callback: PartsCallback) -> None:
        """Run `callback(parts)` once every part has concluded (at once if they have), on the thread
        that concluded the last one. It must not block on the engine."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(callback)
                return
        callback(self)

    def _part_done(self, transfer: Transfer) -> None:
        with self._lock:
            first_failure = transfer.error is not None and self._error is None
            if first_failure:
                self._error = transfer.error
            self._left -= 1
            last = self._left == 0
            callbacks = self._callbacks if last else None
            if last:
                self._callbacks = None
        if first_failure and not last:
            # Outside the lock: aborting a part not started concludes it here, on this thread.
            for other in self.transfers:
                if other is not transfer:
                    other.abort(f"another channel's part of the request failed: {transfer.error.reason}")
        if last:
            self._done.set()  # before the callbacks: they read `error`
            for callback in callbacks or ():
                callback(self)


def expect_parts(
    receivers: Sequence[EnvelopeReceiver], envelope: Envelope, buffer: torch.Tensor, **expect_args
) -> Parts:
    """A destination rank: expect `envelope` on each of its channels (`EnvelopeReceiver.expect`'s
    keyword arguments for each); each channel fills its part of the rank's shard."""
    return _each(lambda receiver: receiver.expect(envelope, buffer, **expect_args), receivers)


def submit_parts(
    senders: Sequence[EnvelopeSender], envelope: Envelope, buffer: torch.Tensor, **submit_args
) -> Parts:
    """A source rank: submit `envelope` on each of its channels (`EnvelopeSender.submit`'s keyword
    arguments for each); each channel sends the part its destination rank needs."""
    return _each(lambda sender: sender.submit(envelope, buffer, **submit_args), senders)


def _each(start: Callable[[object], Transfer], ends: Sequence[object]) -> Parts:
    """One transfer per end; if one cannot start (ValueError, a closed receiver), the ones started
    are aborted before the error propagates: nothing stays registered for the request."""
    started: list[Transfer] = []
    try:
        for end in ends:
            started.append(start(end))
    except Exception:
        for transfer in started:
            transfer.abort("another channel's part of the request could not start")
        raise
    return Parts(started)
