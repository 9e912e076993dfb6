"""Faults a transfer can be made to suffer on purpose (`--fault-rate`, `scripts/soak.py`).

Each is injected through a transfer's chunk hook, so it strikes mid-stream, where real faults hurt:

    sender_abort      the sender aborts after its first chunk (both ends fail, the channel stays up)
    stall             the sender freezes past the deadline (both ends fail, the channel is rebuilt)
    delay_control     the sender holds its END back a while, within the deadline (the transfer succeeds)
    corrupt_payload   one landed byte flips at the receiver (its checksum, if on, refuses the envelope)

The driver adds `receiver_cancel` (decode gives the reservation up mid-transfer) and the soak kills
worker processes.
"""

from __future__ import annotations

import time

import torch

from transfer.handle import ChunkHook, Transfer

SENDER_ABORT, STALL, DELAY_CONTROL = "sender_abort", "stall", "delay_control"
CORRUPT_PAYLOAD = "corrupt_payload"
SENDER_FAULTS = (SENDER_ABORT, STALL, DELAY_CONTROL)
RECEIVER_FAULTS = (CORRUPT_PAYLOAD,)
INJECTED = "injected fault"
DELAY_S = 0.2  # how long delay_control holds the END back


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
