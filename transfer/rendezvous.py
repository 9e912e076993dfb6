"""Rendezvous: the TCPStore of one channel and the generation both ends agree to build next.

Rank 0 hosts the store at `host:port` and keeps it across rebuilds; rank 1 connects a fresh client
each time (rank 0 may have restarted). Every (re)connect is a new *generation* with its own key
prefix, so keys of a dead group never leak into the next:

    rank 0: gen = add("gen", 1); set("gen_current", gen)
    rank 1: read gen_current; claim it with add("join/{gen}", 1) == 1, else wait for a newer one
            (a generation a previous incarnation of rank 1 claimed is stale)
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import time

import torch.distributed as dist

from transfer.auth import ControlAuth
from transfer.errors import ChannelError
from transfer.protocol import (
    current_generation_key,
    generation_counter_key,
    generation_prefix,
    join_key,
)

POLL_S = 0.05


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (for a rank-0 store to bind next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def host_store(host: str, port: int, deadline: float) -> dist.TCPStore:
    """Rank 0's store: the server, listening on `host:port` only (the address its peer uses, not every
    interface), and this process's client of it. The store owns the listening socket from then on."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        store = dist.TCPStore(
            host,
            port,
            None,
            True,
            delta(deadline - time.monotonic()),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store closes the descriptor when it goes
    return store


def join_store(host: str, port: int, deadline: float) -> dist.TCPStore:
    """A client of rank 0's store, or ChannelError if none listens by the deadline.

    TCPStore's own client retries on a back-off that can overshoot its timeout by seconds; probing
    the port first keeps "the peer never showed up" within the channel's timeout.
    """
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ChannelError(f"no rendezvous store at {host}:{port}: the rank-0 peer never showed up")
        try:
            socket.create_connection((host, port), timeout=min(remaining, 0.5)).close()
            break
        except OSError:
            time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
    return dist.TCPStore(host, port, None, False, delta(deadline - time.monotonic()))


def next_generation(store: dist.Store, *, auth: ControlAuth, rank: int, deadline: float) -> int:
    """The generation this connect builds: rank 0 opens it, rank 1 claims the one rank 0 opened.
    Every key is named by `auth`: an outsider can neither find nor claim a generation."""
    name = auth.channel
    counter, current = auth.key(generation_counter_key(name)), auth.key(current_generation_key(name))
    if rank == 0:
        generation = store.add(counter, 1)
        store.set(current, auth.seal(current, str(generation).encode()))
        return generation
    while True:
        store.wait([current], delta(deadline - time.monotonic()))
        opened = auth.open(current, store.get(current))
        if opened is None or not opened.isdigit():
            raise ChannelError(f"channel {name}: the rendezvous was not written by this deployment")
        generation = int(opened)
        if store.add(auth.key(join_key(name, generation)), 1) == 1:
            return generation
        if time.monotonic() + POLL_S > deadline:
            raise ChannelError(
                f"channel {name}: no fresh generation from rank 0 within the timeout "
                "(is the peer rebuilding?)"
            )
        time.sleep(POLL_S)


def generation_store(store: dist.Store, *, auth: ControlAuth, generation: int) -> dist.PrefixStore:
    """The store of one generation: the hello, Gloo's own keys and every control message live under
    a prefix only holders of the secret can name."""
    return dist.PrefixStore(auth.key(generation_prefix(auth.channel, generation)) + "/", store)
