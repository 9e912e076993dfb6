"""The process group of one TP group's ranks, formed through the same proven rendezvous as a channel.

A prefill or decode worker may be N rank processes on one node that all-reduce over a group of
exactly those N. They form it the way a channel's two ends do (`transfer.connect.rendezvous`), never through
a store any local process could write into:

    rank 0:      bind host:port, listen until ranks 1..N-1 proved the secret (one connection each)
    rank 1..N-1: connect to host:port, prove the secret both ways
    all:         a RelayStore over those connections (rank 0 relays), the group through it,
                 one all-reduce (every rank formed; NCCL forms its communicator here), close the store

The port and the store last only while the group forms, whatever the outcome.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist

from transfer.connect.auth import ControlAuth
from transfer.connect.errors import RankGroupNotFormed
from transfer.connect.groups import gloo_group, nccl_group
from transfer.connect.relay_store import RelayStore
from transfer.connect.rendezvous import RendezvousPort, delta, is_loopback, join_peer
from transfer.wire import ArgInvalid, ChannelError


def form_rank_group(
    *,
    name: str,
    rank: int,
    size: int,
    host: str,
    port: int,
    secret: bytes,
    device: torch.device,
    timeout_s: float,
) -> dist.ProcessGroup:
    """This rank's member of the `size`-rank group `name`: Gloo for a CPU `device`, NCCL for a CUDA
    one. Every rank calls it with the same name, size, host, port and secret; rank 0 binds the port.
    `timeout_s` bounds the forming (RankGroupNotFormed when a rank does not show up or prove the secret by
    then) and, as the group's timeout, every collective on it."""
    if size < 2:
        raise ArgInvalid("size", size, "2 or more: one rank has no group to form")
    if not 0 <= rank < size:
        raise ArgInvalid("rank", rank, f"in 0..{size - 1}")
    if timeout_s <= 0:
        raise ArgInvalid("timeout_s", timeout_s, "> 0")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ArgInvalid("device", str(device), "a CPU (Gloo) or CUDA (NCCL) device")
    auth = ControlAuth(secret, name)  # ValueError for a secret too short
    deadline = time.monotonic() + timeout_s
    rendezvous_port, socks, store = None, [], None
    try:
        if rank == 0:
            rendezvous_port = RendezvousPort(host, port)
            socks = rendezvous_port.accept_peers(auth, deadline, size - 1)
        else:
            socks = [join_peer(host, port, auth, deadline)]
        store = RelayStore(socks, name=f"rank group {name}", timeout_s=deadline - time.monotonic())
        group = _group(store, rank, size, device, timeout_s, loopback=is_loopback(host))
        _all_formed(group, device, deadline)
        return group
    except Exception as exc:  # store / Gloo / NCCL errors arrive as RuntimeError subclasses
        cause = exc if isinstance(exc, ChannelError) else ChannelError(f"{type(exc).__name__}: {exc}")
        raise RankGroupNotFormed(name, rank, size, host, port, timeout_s, cause) from None
    finally:
        _close(store, socks, rendezvous_port)


def _group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float, *, loopback: bool
) -> dist.ProcessGroup:
    if device.type == "cuda":
        return nccl_group(store, rank, size, device, timeout=delta(timeout_s))
    return gloo_group(store, rank, size, delta(timeout_s), 1, loopback=loopback)


def _all_formed(group: dist.ProcessGroup, device: torch.device, deadline: float) -> None:
    """One all-reduce before the store closes: NCCL reads the store only at its first collective,
    and a rank that returns has then seen every other rank in the group."""
    ones = torch.ones(1, device=device)
    group.allreduce([ones]).wait(delta(deadline - time.monotonic()))
    counted = int(ones.item())  # waits for the device too
    if counted != group.size():
        raise ChannelError(f"the first all-reduce counted {counted} ranks, not {group.size()}")


def _close(store: RelayStore | None, socks: list[socket.socket], port: RendezvousPort | None) -> None:
    if store is not None:
        store.close()  # closes the connections too
    else:
        for sock in socks:
            sock.close()
    if port is not None:
        port.close()
