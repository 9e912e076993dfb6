"""The rendezvous store of a group forming: one copy of one key-value map at every rank.

A process group needs a store to form (Gloo and NCCL exchange their addresses through it). The
ranks need no server for that: each keeps its own copy, kept in step over connections that proved
the secret (`transfer.connect.rendezvous`). Rank 0, the hub, holds one connection per other rank; every
other rank holds one, to the hub (a channel's two ends: one connection each).

    set at any rank:        file it locally, send it down every connection
    frame from connection:  relay it down every other connection, then file it locally

The hub relays before it files, so whatever a waiter at the hub has seen is already on its way to
every rank. `get` and `wait` wait on the local copy. Nothing else can write into it, and it lasts
only while the group forms: `close` ends it, after which waits fail.

    frame: u32 key length | u32 value length | key | value

A connection that ends (its rank formed and closed its copy) is done: nothing more is sent down it,
and the store ends once every connection has ended. A connection that fails, or a frame over
`MAX_KEY_BYTES` / `MAX_VALUE_BYTES` (a peer out of step), ends the store at once: the group cannot
form. `add` and `compare_set` are not offered: no process group needs them to form, and copies
cannot agree on them without a round trip.
"""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

from transfer.wire import ChannelError

MAX_KEY_BYTES = 8 << 10
MAX_VALUE_BYTES = 16 << 20
CLOSE_DRAIN_S = 1.0  # at close, how long the peers' last frames and their ends of the connections may take
_FRAME = struct.Struct("<II")


class RelayStore(dist.Store):
    """One rank's copy of the store, kept in step with the others' over `socks` (connected, and
    authenticated by the caller): the hub's one per other rank, or another rank's one to the hub.
    `name` says whose rendezvous it is ("channel p", "rank group tp0"), for messages."""

    def __init__(self, socks: Sequence[socket.socket], *, name: str, timeout_s: float) -> None:
        super().__init__()
        if not socks:
            raise ValueError("a store needs at least one connection")
        self._socks, self._name, self._timeout_s = list(socks), name, timeout_s
        self._values: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()  # one frame at a time down any connection
        self._done: set[socket.socket] = set()  # connections whose peer ended them (under _send_lock)
        self._ended: str | None = None
        for sock in self._socks:
            sock.settimeout(None)
        self._readers = [
            threading.Thread(target=self._read, args=(sock,), name=f"rendezvous-{name}", daemon=True)
            for sock in self._socks
        ]
        for reader in self._readers:
            reader.start()

    # ---- the store interface the process groups use ---------------------------------------------
    def set(self, key, value) -> None:
        key, value = _text(key), bytes(value)
        with self._cond:
            self._check_open()
            self._values[key] = value
            self._cond.notify_all()
        try:
            self._send(key, value, but=None)
        except OSError as exc:
            self._end(f"a peer went while the group formed: {exc}")
            raise ChannelError(f"{self._name}: {self._ended}") from None

    def get(self, key) -> bytes:
        key = _text(key)
        self.wait([key])
        with self._cond:
            return self._values[key]

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        keys = [_text(k) for k in keys]
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + seconds
        with self._cond:
            while not all(k in self._values for k in keys):
                self._check_open()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [k for k in keys if k not in self._values]
                    raise dist.DistStoreError(f"{self._name}: no {missing} from the peers in {seconds:.1f} s")
                self._cond.wait(remaining)

    def check(self, keys) -> bool:
        with self._cond:
            return self._ended is None and all(_text(k) in self._values for k in keys)

    def delete_key(self, key) -> bool:
        with self._cond:
            return self._values.pop(_text(key), None) is not None

    def num_keys(self) -> int:
        with self._cond:
            return len(self._values)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def add(self, key, amount):
        raise ChannelError("a relay store keeps no shared counters")

    def compare_set(self, key, expected, desired):
        raise ChannelError("a relay store offers no compare-and-set")

    # ---- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """End the store: what was sent still reaches the peers (each connection is shut for
        writing first, then drained until its peer shuts its side, at most CLOSE_DRAIN_S in all),
        then they close."""
        with self._cond:
            self._ended = self._ended or "the group formed: its rendezvous is over"
            self._cond.notify_all()
        for sock in self._socks:  # not under the send lock: this also wakes a send to a stuck peer
            _shut_for_writing(sock)
        drain_until = time.monotonic() + CLOSE_DRAIN_S
        for reader in self._readers:
            reader.join(max(drain_until - time.monotonic(), 0.0))
        for sock in self._socks:
            sock.close()

    def _check_open(self) -> None:
        if self._ended is not None:
            raise ChannelError(f"{self._name}: {self._ended}")

    def _end(self, reason: str) -> None:
        with self._cond:
            self._ended = self._ended or reason
            self._cond.notify_all()

    def _send(self, key: str, value: bytes, *, but: socket.socket | None) -> None:
        """Send one frame down every connection still in use but `but` (where it came from)."""
        encoded = key.encode()
        frame = _FRAME.pack(len(encoded), len(value)) + encoded + value
        with self._send_lock:
            for sock in self._socks:
                if sock is not but and sock not in self._done:
                    sock.sendall(frame)

    def _read(self, sock: socket.socket) -> None:
        try:
            while (head := _read_exactly(sock, _FRAME.size)) is not None:
                key_len, value_len = _FRAME.unpack(head)
                if key_len > MAX_KEY_BYTES or value_len > MAX_VALUE_BYTES:
                    raise ChannelError(
                        f"a rendezvous frame of {key_len} + {value_len} bytes "
                        f"(at most {MAX_KEY_BYTES} + {MAX_VALUE_BYTES})"
                    )
                body = _read_exactly(sock, key_len + value_len)
                if body is None:
                    break
                key, value = body[:key_len].decode(errors="replace"), body[key_len:]
                self._send(key, value, but=sock)  # relayed before any waiter here can see it
                with self._cond:
                    self._values[key] = value
                    self._cond.notify_all()
        except (OSError, ChannelError) as exc:
            self._end(f"the rendezvous with a peer failed: {exc}")
            return
        self._peer_ended(sock)

    def _peer_ended(self, sock: socket.socket) -> None:
        """`sock`'s peer is done with the store: it gets nothing more (shut for writing, so that its
        close need not wait to drain), and the store ends once every peer is done."""
        with self._send_lock:
            self._done.add(sock)
            _shut_for_writing(sock)
            everyone = len(self._done) == len(self._socks)
        if everyone:
            self._end(
                "the peer ended the rendezvous"
                if len(self._socks) == 1
                else "every peer ended the rendezvous"
            )


def _shut_for_writing(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # already gone
        pass


def _read_exactly(sock: socket.socket, nbytes: int) -> bytes | None:
    """`nbytes` from `sock`, or None at the end of the stream."""
    chunks, left = [], nbytes
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _text(key) -> str:
    return key.decode() if isinstance(key, bytes) else str(key)
