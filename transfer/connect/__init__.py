"""How ranks meet: a rendezvous that proves the deployment's secret, then a process group.

`rendezvous.py`: rank 0's port, proofs on fresh nonces, one generation agreed; `auth.py`: the proof
and sealed messages; `relay_store.py`: the store every rank keeps a copy of while a group forms;
`groups.py`: the Gloo and NCCL groups made and their links closed (torch's private Gloo options);
`rank_group.py`: a TP group's own process group, formed the same way; `errors.py`: what the
rendezvous and the forming fail with, as facts.
"""

from transfer.connect.auth import MAC_BYTES, ControlAuth
from transfer.connect.errors import (
    FORMED,
    PEER_FAILED,
    PEERS_DONE,
    FrameTooLarge,
    PeersMissing,
    RankGroupNotFormed,
    RendezvousHungUp,
    SecretNotProven,
    StoreEnded,
)
from transfer.connect.groups import channel_groups, close_links, destroy_group
from transfer.connect.rank_group import form_rank_group
from transfer.connect.relay_store import RelayStore
from transfer.connect.rendezvous import (
    RendezvousPort,
    agree_generation,
    delta,
    is_loopback,
    join_peer,
    reserve_port,
)

__all__ = [
    "ControlAuth",
    "FORMED",
    "FrameTooLarge",
    "MAC_BYTES",
    "PEERS_DONE",
    "PEER_FAILED",
    "PeersMissing",
    "RankGroupNotFormed",
    "RelayStore",
    "RendezvousHungUp",
    "RendezvousPort",
    "SecretNotProven",
    "StoreEnded",
    "agree_generation",
    "channel_groups",
    "close_links",
    "delta",
    "destroy_group",
    "form_rank_group",
    "is_loopback",
    "join_peer",
    "reserve_port",
]
