"""Faults a transfer can be made to suffer on purpose (`--fault-rate`, `scripts/soak.py`).

Each is injected through a transfer's chunk hook, so it strikes mid-stream, where real faults hurt:

    sender_abort      the sender aborts after its first chunk (both ends fail, the channel stays up)
    stall             the sender freezes past the deadline (both ends fail, the channel is rebuilt)
    delay_control     the sender holds the rest of its stream back a while, within the deadline (the
                      transfer succeeds)
    corrupt_payload   one landed byte flips at the receiver (its checksum, if on, refuses the envelope)

A `FaultInjector` is the one seam that plans them for a request. The driver adds `receiver_cancel`
(decode gives the reservation up mid-transfer) and the soak kills worker processes.
"""

from __future__ import annotations

import threading
import time

import torch

from transfer.ends import ChunkHook, Transfer
from transfer.wire import ArgInvalid

SENDER_ABORT, STALL, DELAY_CONTROL = "sender_abort", "stall", "delay_control"
CORRUPT_PAYLOAD = "corrupt_payload"
SENDER_FAULTS = (SENDER_ABORT, STALL, DELAY_CONTROL)
RECEIVER_FAULTS = (CORRUPT_PAYLOAD,)
INJECTED = "injected fault"
DELAY_S = 0.2  # how long delay_control holds the stream back


def sender_hook(kind: str, timeout_s: float) -> ChunkHook:
    """The chunk hook that injects `kind` (one of SENDER_FAULTS) at the sender."""
    if kind not in SENDER_FAULTS:
        raise ValueError(f"{kind!r} is not a sender fault; those are {', '.join(SENDER_FAULTS)}")
    done = []

    def hook(transfer: Transfer, chunk: int) -> None:
        if done:
            return
        done.append(chunk)
        if kind == SENDER_ABORT:
            transfer.abort(f"{INJECTED}: {kind}")
        elif kind == STALL:
            time.sleep(timeout_s + 0.2)  # past the receiver's deadline: it gives up, the link breaks
        else:
            time.sleep(DELAY_S)

    return hook


def receiver_hook(kind: str, buffer: torch.Tensor, ranges: torch.Tensor) -> ChunkHook:
    """The chunk hook that injects `kind` (one of RECEIVER_FAULTS) at the receiver: after the first
    chunk lands, the first byte of the envelope flips."""
    if kind not in RECEIVER_FAULTS:
        raise ValueError(f"{kind!r} is not a receiver fault; those are {', '.join(RECEIVER_FAULTS)}")
    offset = int(ranges[0, 0])

    def hook(transfer: Transfer, chunk: int) -> None:
        if chunk == 0:
            buffer[offset] ^= 0xFF

    return hook


class FaultInjector:
    """The one seam through which faults are injected on purpose: each worker's channels own one
    (`PeerChannels.faults`). Tests and `--fault-rate` `plan` a fault for a request; the channels
    consult the injector where that request's next transfer is queued (`sender_hook`) or expected
    (`receiver_hook`), which takes the plan (a later transfer of it gets none unless planned again).
    Nothing planned: every consultation returns None."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._planned: dict[str, str] = {}  # request id -> fault kind

    def plan(self, request_id: str, kind: str | None) -> bool:
        """Inject `kind` (one of SENDER_FAULTS or RECEIVER_FAULTS) into the next transfer of
        `request_id` here; None forgets a plan not taken. Returns whether a plan not taken was
        dropped (so with None after an attempt: False where its transfer took the plan)."""
        if kind is not None and kind not in SENDER_FAULTS + RECEIVER_FAULTS:
            raise ArgInvalid(
                "kind", kind, "a transfer fault: one of " + ", ".join(SENDER_FAULTS + RECEIVER_FAULTS)
            )
        with self._lock:
            dropped = self._planned.pop(request_id, None) is not None
            if kind is not None:
                self._planned[request_id] = kind
            return dropped

    def _take(self, request_id: str, kinds: tuple[str, ...]) -> str | None:
        with self._lock:
            if self._planned.get(request_id) not in kinds:
                return None
            return self._planned.pop(request_id)

    def sender_hook(self, request_id: str, timeout_s: float) -> ChunkHook | None:
        """The hook of the sender fault planned for `request_id` (taken), or None."""
        kind = self._take(request_id, SENDER_FAULTS)
        return None if kind is None else sender_hook(kind, timeout_s)

    def receiver_hook(self, request_id: str, buffer: torch.Tensor, ranges: torch.Tensor) -> ChunkHook | None:
        """The hook of the receiver fault planned for `request_id` (taken), or None; `ranges` are the
        bytes the transfer writes (a fault strikes one of them, never a held page)."""
        kind = self._take(request_id, RECEIVER_FAULTS)
        return None if kind is None else receiver_hook(kind, buffer, ranges)
