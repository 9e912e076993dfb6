"""The in-process engine pair the transfer scenarios share."""

from __future__ import annotations

import threading

import pytest

from tests.transfer.transfer_peer import FINGERPRINT, LAYOUT, SECRET, free_port
from transfer import Channel, EnvelopeReceiver, EnvelopeSender, TransferOptions
from transfer.defaults import UNEXPECTED_WAIT_S
from transfer.ends.activity import Activity


def connected_pair(
    name: str,
    *,
    timeout_s: float,
    options: TransferOptions | None = None,
    unexpected_wait_s: float = UNEXPECTED_WAIT_S,
    sender_activity: Activity | None = None,
) -> tuple[EnvelopeSender, EnvelopeReceiver]:
    """A started, connected (sender, receiver) over one in-process channel pair; the caller closes both.
    `sender_activity`: what the sender's transfers count in (its worker's, in a prefill worker)."""
    port = free_port()
    channels = [
        Channel(
            rank=r,
            host="127.0.0.1",
            port=port,
            device="cpu",
            fingerprint=FINGERPRINT,
            layout=LAYOUT,
            timeout_s=timeout_s,
            secret=SECRET,
            name=name,
        )
        for r in (0, 1)
    ]
    sender = EnvelopeSender(channels[0], options, activity=sender_activity)
    receiver = EnvelopeReceiver(channels[1], unexpected_wait_s=unexpected_wait_s)
    sender.start()
    receiver.start()
    connect = threading.Thread(target=receiver.connect)
    connect.start()
    sender.connect()
    connect.join()
    return sender, receiver


@pytest.fixture
def pair():
    """A connected (sender, receiver) pair with small chunks, closed after the test."""
    options = TransferOptions(chunk_bytes=64 << 10, direct_min_bytes=16 << 10)
    sender, receiver = connected_pair("p", timeout_s=5, options=options, unexpected_wait_s=0.3)
    yield sender, receiver
    sender.close()
    receiver.close()
