"""The raw link of a channel: plain messages of N bytes, timed, on the channel's own group.

What an envelope transfer is compared with (link utilization): the same peers, the same process
group and device, no protocol, no gather or scatter. Both ends call `measure` at the same time
while no transfer runs on the channel (each holds its end's io_lock, so none can start). Each round
moves the N bytes twice: as one message, and cut in `chunk_bytes` pieces spread over the channel's
streams with every receive posted at once (what the engine does); the faster way's median counts,
so the raw figure is the best plain sends reach. The receiver times a round from a one-byte "go"
it sends to the last byte it receives.
"""

from __future__ import annotations

import statistics
import time

import torch

from transfer.ends.end import ChannelEnd
from transfer.ends.receiver import EnvelopeReceiver
from transfer.wire import TAG_LINK_GO, TAG_LINK_PAYLOAD, ArgInvalid

MAX_LINK_BYTES = 4 << 30


def message_pieces(nbytes: int, chunk_bytes: int | None) -> list[tuple[int, int]]:
    """(offset, nbytes) of the plain messages that move `nbytes` in `chunk_bytes` pieces (None: one)."""
    if chunk_bytes is None or chunk_bytes >= nbytes:
        return [(0, nbytes)]
    return [(o, min(chunk_bytes, nbytes - o)) for o in range(0, nbytes, chunk_bytes)]


def measure(end: ChannelEnd, nbytes: int, repeats: int, chunk_bytes: int | None = None) -> float | None:
    """Move `repeats` rounds of `nbytes` over `end`'s channel; the receiver returns the median
    seconds of the faster way (one message, or `chunk_bytes` pieces over the streams), the sender
    None. Raises ChannelError when the link fails (the channel is then broken, as after a failed
    transfer)."""
    if not 0 < nbytes <= MAX_LINK_BYTES or not 0 < repeats <= 100:
        raise ArgInvalid(
            "a link measurement (bytes, repeats)", (nbytes, repeats), "1 B to 4 GiB, 1 to 100 times"
        )
    channel = end.channel
    payload = torch.empty(nbytes, dtype=torch.uint8, device=channel.device)
    go = torch.zeros(1, dtype=torch.uint8, device=channel.device)
    receiving = isinstance(end, EnvelopeReceiver)
    ways = {"one message": message_pieces(nbytes, None), "pieces": message_pieces(nbytes, chunk_bytes)}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    with end.io_lock:
        for _ in range(repeats):
            for way, pieces in ways.items():
                deadline = time.monotonic() + channel.timeout_s
                started = time.perf_counter()
                if receiving:
                    channel.wait(channel.send(go, TAG_LINK_GO), deadline, "link go")
                    move = channel.recv
                else:
                    channel.wait(channel.recv(go, TAG_LINK_GO), deadline, "link go")
                    move = channel.send
                works = [
                    move(payload[o : o + n], TAG_LINK_PAYLOAD + i % channel.num_streams)
                    for i, (o, n) in enumerate(pieces)
                ]
                for work in works:
                    channel.wait(work, deadline, "link payload")
                if payload.is_cuda:
                    torch.cuda.synchronize(payload.device)
                seconds[way].append(time.perf_counter() - started)
    return min(statistics.median(s) for s in seconds.values()) if receiving else None
