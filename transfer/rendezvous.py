"""Rendezvous: where the two ends of a channel meet to form a generation, and only while they do.

Rank 0 owns the channel's port for the channel's life (`RendezvousPort`): bound, so nothing else
takes it between rebuilds, but listening only while a generation forms. Each connect starts a fresh
TCPStore on it; once both ends hold their process groups, every reference to the store is dropped
(the groups hold it through a `StoreLease`, released then): the server goes with every key and
connection it held, and the port stops listening. An outsider reaches a store only during that
window, and nothing it wrote there outlives it.

    rank 0: listen; set(gen_current, sealed(gen))       gen: rank 0's own count of generations
    rank 1: join; read gen_current (an authentic value only); claim it with add(join/{gen}, 1) == 1
    both:   hello, groups, ping (transfer.channel); release the store; rank 0 stops listening

Every key is named by `transfer.auth` (an HMAC of the deployment's secret) and every value sealed.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time

import torch.distributed as dist

from transfer.auth import ControlAuth
from transfer.errors import ChannelError
from transfer.protocol import current_generation_key, generation_prefix, join_key

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


class RendezvousPort:
    """Rank 0's port: bound to `host:port` only (the address its peer uses, not every interface)
    from the first connect to `close()`, and listening only between `open_store` and
    `stop_listening`."""

    def __init__(self, host: str, port: int) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            self._reuse(sock, True)  # past a previous life's connections in TIME_WAIT
            sock.bind((host, port))
            self._reuse(sock, False)
        except BaseException:
            sock.close()
            raise
        self.host, self.port, self._socket = host, port, sock

    @staticmethod
    def _reuse(sock: socket.socket, on: bool) -> None:
        # On while binding or listening (connections accepted then inherit it), so that an earlier
        # generation's connections in TIME_WAIT do not refuse the next listen; off otherwise: no
        # other socket may share the port while ours is not listening.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(on))

    def open_store(self, deadline: float) -> dist.TCPStore:
        """Listen, and serve a fresh store (and this process's client of it) on the port."""
        self._reuse(self._socket, True)
        self._socket.listen(128)
        listen_fd = os.dup(self._socket.fileno())  # the store closes its copy when it goes
        try:
            return dist.TCPStore(
                self.host,
                self.port,
                None,
                True,
                delta(deadline - time.monotonic()),
                wait_for_workers=False,
                master_listen_fd=listen_fd,
            )
        except BaseException:
            os.close(listen_fd)
            self.stop_listening()
            raise

    def stop_listening(self) -> None:
        """Stop accepting (connections still queued are reset); the port stays bound to us."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:  # not listening
            pass
        self._reuse(self._socket, False)

    def close(self) -> None:
        self._socket.close()


class StoreLease(dist.Store):
    """The store as the process groups see it: theirs while the generation forms, then released
    (`release`), so that the groups, which keep their store for life, do not keep the server."""

    def __init__(self, store: dist.Store) -> None:
        super().__init__()
        self._store: dist.Store | None = store

    def release(self) -> None:
        self._store = None

    def _held(self) -> dist.Store:
        if self._store is None:
            raise ChannelError("the rendezvous store is gone: the channel formed, and left it")
        return self._store

    def set(self, key, value):
        return self._held().set(key, value)

    def get(self, key):
        return self._held().get(key)

    def add(self, key, amount):
        return self._held().add(key, amount)

    def compare_set(self, key, expected, desired):
        return self._held().compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        return self._held().wait(keys) if timeout is None else self._held().wait(keys, timeout)

    def check(self, keys):
        return False if self._store is None else self._store.check(keys)

    def delete_key(self, key):
        return self._held().delete_key(key)

    def num_keys(self):
        return self._held().num_keys()

    def set_timeout(self, timeout):
        return self._held().set_timeout(timeout)


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


def open_generation(store: dist.Store, *, auth: ControlAuth, generation: int) -> None:
    """Rank 0: announce the generation this connect builds."""
    current = auth.key(current_generation_key(auth.channel))
    store.set(current, auth.seal(current, str(generation).encode()))


def claim_generation(store: dist.Store, *, auth: ControlAuth, deadline: float) -> int:
    """Rank 1: the generation rank 0 announced, claimed so that no other rank 1 joins it. A value
    that does not open (an outsider's, raced in first) is read again until the real one is there."""
    name = auth.channel
    current = auth.key(current_generation_key(name))
    while True:
        store.wait([current], delta(deadline - time.monotonic()))
        opened = auth.open(current, store.get(current))
        if opened is not None and opened.isdigit():
            break
        if time.monotonic() + POLL_S > deadline:
            raise ChannelError(f"channel {name}: the rendezvous was not written by this deployment")
        time.sleep(POLL_S)
    generation = int(opened)
    if store.add(auth.key(join_key(name, generation)), 1) != 1:
        raise ChannelError(f"channel {name}: generation {generation} was claimed by another receiver")
    return generation


def generation_store(store: dist.Store, *, auth: ControlAuth, generation: int) -> dist.PrefixStore:
    """The store of one generation: the hello and Gloo's (or NCCL's) own keys live under a prefix
    only holders of the secret can name."""
    return dist.PrefixStore(auth.key(generation_prefix(auth.channel, generation)) + "/", store)
