"""The in-process engine pair the transfer scenarios share."""

from __future__ import annotations

import threading

import pytest

from tests.transfer.transfer_peer import FINGERPRINT, LAYOUT, SECRET, free_port
from transfer import Channel, EnvelopeReceiver, EnvelopeSender, TransferOptions


@pytest.fixture
def pair():
    """A connected (sender, receiver) pair with small chunks, closed after the test."""
    port = free_port()
    channels = [
        Channel(
            rank=r,
            host="127.0.0.1",
            port=port,
            device="cpu",
            fingerprint=FINGERPRINT,
            layout=LAYOUT,
            timeout_s=5,
            secret=SECRET,
            name="p",
        )
        for r in (0, 1)
    ]
    sender = EnvelopeSender(channels[0], TransferOptions(chunk_bytes=64 << 10, direct_min_bytes=16 << 10))
    receiver = EnvelopeReceiver(channels[1], unexpected_wait_s=0.3)
    sender.start()
    receiver.start()
    connect = threading.Thread(target=receiver.connect)
    connect.start()
    sender.connect()
    connect.join()
    yield sender, receiver
    sender.close()
    receiver.close()
