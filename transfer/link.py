"""The raw link of a channel: one contiguous message of N bytes, timed, on the channel's own group.

What an envelope transfer is compared with (link utilization): the same peers, the same process
group and device, no protocol, no gather or scatter. Both ends call `measure` at the same time
while no transfer runs on the channel (each holds its end's io_lock, so none can start). The
receiver times each round: it sends a one-byte "go" and waits for the payload, so the figure is
one message's time plus one tiny message's latency.
"""

from __future__ import annotations

import statistics
import time

import torch

from transfer.end import ChannelEnd
from transfer.protocol import TAG_LINK_GO, TAG_LINK_PAYLOAD
from transfer.receiver import EnvelopeReceiver

MAX_LINK_BYTES = 4 << 30


def measure(end: ChannelEnd, nbytes: int, repeats: int) -> float | None:
    """Move `repeats` messages of `nbytes` over `end`'s channel; the receiver returns the median
    seconds per message, the sender None. Raises ChannelError when the link fails (the channel is
    then broken, as after a failed transfer)."""
    if not 0 < nbytes <= MAX_LINK_BYTES or not 0 < repeats <= 100:
        raise ValueError(f"a link measurement takes 1 B to 4 GiB, 1 to 100 times; got {nbytes} x {repeats}")
    channel = end.channel
    payload = torch.empty(nbytes, dtype=torch.uint8, device=channel.device)
    go = torch.zeros(1, dtype=torch.uint8, device=channel.device)
    receiving = isinstance(end, EnvelopeReceiver)
    seconds = []
    with end.io_lock:
        for _ in range(repeats):
            deadline = time.monotonic() + channel.timeout_s
            started = time.perf_counter()
            if receiving:
                channel.wait(channel.send(go, TAG_LINK_GO), deadline, "link go")
                channel.wait(channel.recv(payload, TAG_LINK_PAYLOAD), deadline, "link payload")
                if payload.is_cuda:
                    torch.cuda.synchronize(payload.device)
                seconds.append(time.perf_counter() - started)
            else:
                channel.wait(channel.recv(go, TAG_LINK_GO), deadline, "link go")
                channel.wait(channel.send(payload, TAG_LINK_PAYLOAD), deadline, "link payload")
    return statistics.median(seconds) if receiving else None
