"""One channel between a prefill rank and a decode rank, generation after generation.

`channel.py`: the two-rank channel, (re)built through a rendezvous with its own process groups;
`handshake.py`: the hello both ends compare before a group exists; `control.py`: the control plane
of one generation, sealed frames over the pair's own link.
"""

from transfer.pair.channel import RECEIVER_RANK, SENDER_RANK, Channel

__all__ = [
    "Channel",
    "RECEIVER_RANK",
    "SENDER_RANK",
]
