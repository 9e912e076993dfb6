"""A worker's channels (`transfer.peers.PeerChannels`) as the driver asks after them."""

from __future__ import annotations

import torch

from tests.transfer.conftest import connected_pair
from transfer import TransferOptions
from transfer.peers import PeerChannels


def test_a_missing_channel_counts_as_broken_so_that_the_pair_is_rebuilt():
    """Regression: `broken` raised for a peer this rank held no channel to (a rank Ray restarted
    behind the driver's back holds none), so the driver's rebuild after a failed transfer never
    ran and every later transfer on that pair failed."""
    channels = PeerChannels(
        own_name="prefill-0.0",
        rank=0,
        fingerprint="f",
        layout={},
        device=torch.device("cpu"),
        options=TransferOptions(),
        secret=b"s" * 32,
    )
    assert channels.broken("decode-0.0")
    sender, receiver = connected_pair("pc", timeout_s=5)
    try:
        channels._ends["decode-0.0"] = sender  # as `open` files it
        assert not channels.broken("decode-0.0")
        sender.channel.mark_broken("the peer went")
        assert channels.broken("decode-0.0")
        channels.drop("decode-0.0")
        assert channels.broken("decode-0.0")
    finally:
        sender.close()
        receiver.close()
