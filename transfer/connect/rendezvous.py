"""Rendezvous: how the two ends of a channel find each other, prove the secret, and form a generation.

Rank 0 owns the channel's port for the channel's life (`RendezvousPort`): bound, so nothing else
takes it between rebuilds, but listening only while it waits for rank 1 in a connect. Whoever
connects must prove the deployment's secret within `PROOF_S`, on fresh nonces both ways:

    rank 0 -> rank 1:  nonce0                                      (32 bytes)
    rank 1 -> rank 0:  nonce1, proof("client", nonce0, nonce1)     (64 bytes)
    rank 0 -> rank 1:  proof("server", nonce1, nonce0)             (32 bytes)

Rank 0 reads at most 64 bytes from a connection before it has proved itself, keeps at most
`MAX_UNPROVEN` such connections (a new one displaces the oldest), and drops any that fails; it
stops listening as soon as rank 1 proved itself (a TP group's rank 0: as soon as every other rank
did, `accept_peers`). The connections left carry the store (`transfer.connect.relay_store`) while the groups
form, and are closed then. So an outsider who reaches the port while it listens costs a socket and
64 bytes, and nothing it sends is stored or acted on.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import selectors
import socket
import threading
import time

import torch.distributed as dist

from transfer.connect.auth import MAC_BYTES, ControlAuth
from transfer.connect.errors import PeersMissing, RendezvousHungUp, SecretNotProven
from transfer.wire import GENERATION_KEY, ChannelError

POLL_S = 0.05
NONCE_BYTES = 32
PROOF_S = 2.0  # how long a connection may take to prove the secret
MAX_UNPROVEN = 64  # connections proving themselves at once


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, closed again: another process may take it before it is bound.
    Only for a peer process that cannot be handed a socket; `reserve_port` holds the port."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Ports this process reserved (`reserve_port`), bound and held until a `RendezvousPort` takes the
# socket over. One that is never taken (its connect was abandoned) is closed after HELD_S.
HELD_S = 600.0
_held: dict[tuple[str, int], tuple[socket.socket, float]] = {}
_held_lock = threading.Lock()


def reserve_port(host: str = "127.0.0.1") -> int:
    """A port bound on `host` now and held by this process until a `RendezvousPort(host, port)`
    created here takes the bound socket over (or `hold_socket` of a socket handed to another
    process): nothing else can take the port in between, as it could between a `free_port` and
    the bind that follows it."""
    return hold_socket(reserve_socket(host))


def reserve_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free port of `host`, to hand to the process that will listen there (it
    passes it to `hold_socket`, or a TCPStore takes its descriptor); the caller closes its copy.

    Bound by its number, not as port 0: a socket the kernel gave a port to gives it back when it
    stops listening, and would listen on another port at the next rebuild. The port is found with
    a first socket, which holds it until the second is bound (both allow it, neither listens)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as finder:
        finder.bind((host, 0))
        finder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return _bound_socket(host, finder.getsockname()[1])


def hold_socket(sock: socket.socket) -> int:
    """Hold `sock`, bound and not listening, until a `RendezvousPort` of its address takes it over;
    its port."""
    host, port = sock.getsockname()[:2]
    now = time.monotonic()
    with _held_lock:
        for key, (old, since) in list(_held.items()):
            if now - since > HELD_S:
                old.close()
                del _held[key]
        _held[(host, port)] = (sock, now)
    return port


def _take_held(host: str, port: int) -> socket.socket | None:
    with _held_lock:
        held = _held.pop((host, port), None)
    return held[0] if held is not None else None


def _bound_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        RendezvousPort._reuse(sock, True)  # past a previous life's connections in TIME_WAIT
        sock.bind((host, port))
        RendezvousPort._reuse(sock, False)
    except BaseException:
        sock.close()
        raise
    return sock


def delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class RendezvousPort:
    """Rank 0's port: bound to `host:port` only (the address its peer uses, not every interface)
    from the first connect to `close()`, and listening only inside `accept_peer`. A port this
    process reserved (`reserve_port`) is taken over already bound."""

    def __init__(self, host: str, port: int) -> None:
        sock = _take_held(host, port) or _bound_socket(host, port)
        self.host, self.port, self._socket = host, port, sock

    @staticmethod
    def _reuse(sock: socket.socket, on: bool) -> None:
        # On while binding or listening (connections accepted then inherit it), so that an earlier
        # generation's connections in TIME_WAIT do not refuse the next listen; off otherwise: no
        # other socket may share the port while ours is not listening.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(on))

    def accept_peer(self, auth: ControlAuth, deadline: float) -> socket.socket:
        """Listen until a connection proves the secret (returned, blocking) or the deadline passes
        (ChannelError); the port stops listening either way."""
        return self.accept_peers(auth, deadline, 1)[0]

    def accept_peers(self, auth: ControlAuth, deadline: float, num_peers: int) -> list[socket.socket]:
        """Listen until `num_peers` connections proved the secret (returned, blocking, in the order
        they proved it) or the deadline passes (ChannelError); the port stops listening either way.
        All are taken in one listen: peers connecting at once are all heard."""
        self._reuse(self._socket, True)
        self._socket.listen(MAX_UNPROVEN)
        self._socket.setblocking(False)
        unproven: dict[socket.socket, tuple[bytes, bytearray, float]] = {}  # nonce0, read, expiry
        proven: list[socket.socket] = []
        with selectors.DefaultSelector() as selector:
            selector.register(self._socket, selectors.EVENT_READ)
            try:
                while (remaining := deadline - time.monotonic()) > 0:
                    for key, _ in selector.select(min(remaining, POLL_S)):
                        if key.fileobj is self._socket:
                            self._admit(selector, unproven)
                        elif (peer := self._hear(key.fileobj, selector, unproven, auth)) is not None:
                            proven.append(peer)
                            if len(proven) == num_peers:
                                return proven
                    for sock, (_, _, expiry) in list(unproven.items()):
                        if time.monotonic() > expiry:
                            _drop(sock, selector, unproven)
                raise PeersMissing(
                    self.host, self.port, awaited=num_peers, proven=len(proven), listening=True
                )
            except BaseException:
                for sock in proven:
                    sock.close()
                raise
            finally:
                for sock in list(unproven):
                    _drop(sock, selector, unproven)
                self.stop_listening()

    def _admit(self, selector: selectors.BaseSelector, unproven: dict) -> None:
        try:
            sock, _ = self._socket.accept()
        except OSError:  # the connection went before we took it
            return
        if len(unproven) >= MAX_UNPROVEN:  # the oldest makes room: stalled ones cannot keep the peer out
            _drop(next(iter(unproven)), selector, unproven)
        nonce = os.urandom(NONCE_BYTES)
        try:
            sock.setblocking(False)
            sock.send(nonce)  # 32 bytes into a fresh connection's empty buffer
        except OSError:
            sock.close()
            return
        unproven[sock] = (nonce, bytearray(), time.monotonic() + PROOF_S)
        selector.register(sock, selectors.EVENT_READ)

    def _hear(
        self, sock, selector: selectors.BaseSelector, unproven: dict, auth: ControlAuth
    ) -> socket.socket | None:
        """Read what a connection sent (at most its 64 bytes); the connection once it proved the
        secret, else None (it is dropped if it failed)."""
        nonce, got, _ = unproven[sock]
        try:
            chunk = sock.recv(NONCE_BYTES + MAC_BYTES - len(got))
        except OSError:
            chunk = b""
        if not chunk:
            _drop(sock, selector, unproven)
            return None
        got += chunk
        if len(got) < NONCE_BYTES + MAC_BYTES:
            return None
        theirs, mac = bytes(got[:NONCE_BYTES]), bytes(got[NONCE_BYTES:])
        if not auth.proves("client", nonce, theirs, mac):
            _drop(sock, selector, unproven)
            return None
        selector.unregister(sock)
        del unproven[sock]
        sock.setblocking(True)
        try:
            sock.sendall(auth.proof("server", theirs, nonce))
        except OSError as exc:
            sock.close()
            raise ChannelError(f"a peer went right after it proved the secret: {exc}") from None
        return sock

    def stop_listening(self) -> None:
        """Stop accepting (connections still queued are reset); the port stays bound to us."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:  # not listening
            pass
        self._reuse(self._socket, False)

    def close(self) -> None:
        self._socket.close()


def _drop(sock, selector: selectors.BaseSelector, unproven: dict) -> None:
    selector.unregister(sock)
    del unproven[sock]
    sock.close()


def join_peer(host: str, port: int, auth: ControlAuth, deadline: float) -> socket.socket:
    """Rank 1: connect to rank 0's port and prove the secret both ways; the connection (blocking),
    or ChannelError when no rank 0 of this deployment answers by the deadline.

    A connection refused, or reset before rank 0 sent its nonce, is tried again until the deadline:
    rank 0 stops listening between generations, and a connection queued just as it stopped is
    reset without a word. Once the nonce came, a failure is final. Reset every time until the
    deadline: RendezvousHungUp, however the deadline falls between the tries."""
    hung_up = False
    while True:
        try:
            sock = _connect(host, port, deadline)
        except PeersMissing:
            if hung_up:  # rank 0 did answer, and hung up: the deadline came in the pause after
                raise RendezvousHungUp(host, port) from None
            raise
        try:
            sock.settimeout(max(min(PROOF_S, deadline - time.monotonic()), 0.001))
            theirs = _receive(sock, NONCE_BYTES)
        except (OSError, ChannelError):
            sock.close()
            hung_up = True
            if deadline - time.monotonic() <= POLL_S:
                raise RendezvousHungUp(host, port) from None
            time.sleep(POLL_S)
            continue
        break
    try:
        nonce = os.urandom(NONCE_BYTES)
        sock.sendall(nonce + auth.proof("client", theirs, nonce))
        if not auth.proves("server", nonce, theirs, _receive(sock, MAC_BYTES)):
            raise SecretNotProven(host, port)
        sock.settimeout(None)
        return sock
    except (OSError, ChannelError) as exc:
        sock.close()
        if isinstance(exc, ChannelError):
            raise
        raise ChannelError(f"the rendezvous at {host}:{port} failed: {exc}") from None


def _connect(host: str, port: int, deadline: float) -> socket.socket:
    """A connection to `host:port`, tried until the deadline (ChannelError after it)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeersMissing(host, port, awaited=1, proven=0, listening=False)
        try:
            return socket.create_connection((host, port), timeout=min(remaining, 0.5))
        except OSError:
            time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))


def _receive(sock: socket.socket, nbytes: int) -> bytes:
    got = b""
    while len(got) < nbytes:
        chunk = sock.recv(nbytes - len(got))
        if not chunk:
            raise ChannelError("the rank-0 peer hung up during the rendezvous")
        got += chunk
    return got


def agree_generation(store: dist.Store, *, rank: int, last: int, name: str) -> int:
    """The generation this connect forms: rank 0 numbers it (one past its `last`), rank 1 takes
    rank 0's number from the store."""
    if rank == 0:
        store.set(GENERATION_KEY, str(last + 1).encode())
        return last + 1
    number = store.get(GENERATION_KEY).decode(errors="replace")
    if not number.isdigit():
        raise ChannelError(f"channel {name}: the peer numbered its generation {number!r}")
    return int(number)
