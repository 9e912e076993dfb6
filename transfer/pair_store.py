"""The rendezvous store of one channel generation: two copies of one key-value map, one per end.

A process group needs a store to form (Gloo and NCCL exchange their addresses through it). Two
ends need no server for that: each keeps its own copy, `set` writes it and sends the pair to the
peer over their one authenticated connection (`transfer.rendezvous`), and a reader thread files
what the peer sends. `get` and `wait` wait on the local copy. Nothing else can write into it, and it
lasts only while the generation forms: `close` ends it, after which waits fail.

    frame: u32 key length | u32 value length | key | value

A frame over `MAX_KEY_BYTES` / `MAX_VALUE_BYTES` ends the store (the peer is out of step). `add` and
`compare_set` are not offered: no process group needs them to form, and two copies cannot agree on
them without a round trip.
"""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time

import torch.distributed as dist

from transfer.errors import ChannelError

MAX_KEY_BYTES = 8 << 10
MAX_VALUE_BYTES = 16 << 20
CLOSE_DRAIN_S = 1.0  # at close, how long the peer's last frames and its end of the connection may take
_FRAME = struct.Struct("<II")


class PairStore(dist.Store):
    """One end's copy of the store, kept in step with the peer's over `sock` (connected, and
    authenticated by the caller). `name` is the channel's, for messages."""

    def __init__(self, sock: socket.socket, *, name: str, timeout_s: float) -> None:
        super().__init__()
        self._sock, self._name, self._timeout_s = sock, name, timeout_s
        self._values: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._ended: str | None = None
        sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, name=f"rendezvous-{name}", daemon=True)
        self._reader.start()

    # ---- the store interface the process groups use ---------------------------------------------
    def set(self, key, value) -> None:
        key, value = _text(key), bytes(value)
        with self._cond:
            self._check_open()
            self._values[key] = value
            self._cond.notify_all()
        encoded = key.encode()
        try:
            with self._send_lock:
                self._sock.sendall(_FRAME.pack(len(encoded), len(value)) + encoded + value)
        except OSError as exc:
            self._end(f"the peer went while the channel formed: {exc}")
            raise ChannelError(f"channel {self._name}: {self._ended}") from None

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
                    raise dist.DistStoreError(
                        f"channel {self._name}: no {missing} from the peer in {seconds:.1f} s"
                    )
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
        raise ChannelError("a pair store keeps no shared counters")

    def compare_set(self, key, expected, desired):
        raise ChannelError("a pair store offers no compare-and-set")

    # ---- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """End the store: what was sent still reaches the peer (the connection is shut for writing
        first, then drained until the peer shuts its side, at most CLOSE_DRAIN_S), then it closes."""
        with self._cond:
            self._ended = self._ended or "the channel formed: its rendezvous is over"
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:  # already gone
            pass
        self._reader.join(CLOSE_DRAIN_S)
        self._sock.close()

    def _check_open(self) -> None:
        if self._ended is not None:
            raise ChannelError(f"channel {self._name}: {self._ended}")

    def _end(self, reason: str) -> None:
        with self._cond:
            self._ended = self._ended or reason
            self._cond.notify_all()

    def _read(self) -> None:
        try:
            while (head := _read_exactly(self._sock, _FRAME.size)) is not None:
                key_len, value_len = _FRAME.unpack(head)
                if key_len > MAX_KEY_BYTES or value_len > MAX_VALUE_BYTES:
                    raise ChannelError(f"a rendezvous frame of {key_len} + {value_len} bytes")
                body = _read_exactly(self._sock, key_len + value_len)
                if body is None:
                    break
                with self._cond:
                    self._values[body[:key_len].decode(errors="replace")] = body[key_len:]
                    self._cond.notify_all()
        except (OSError, ChannelError) as exc:
            self._end(f"the rendezvous with the peer failed: {exc}")
            return
        self._end("the peer ended the rendezvous")


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
