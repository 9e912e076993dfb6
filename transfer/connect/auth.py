"""Who may steer a channel: a per-deployment secret, proved at the rendezvous, and a MAC on every message.

An end takes part in a channel's rendezvous only once it proved it holds the secret (`proof`, over
fresh nonces from both ends; see `transfer.connect.rendezvous`), so nothing but the peer writes into the
generation's store, where the groups exchange the addresses they connect to. Beyond that, every
value a channel reads (the hello, every control message) is sealed with an HMAC over the value and
the full name it was written under (channel, generation, the writer's rank, kind and sequence), so
that a forged message, and a replay of an authentic one under any other name, is refused, counted
and dropped should anything but the peer ever reach the link.

    key(name)        = "dp/" + HMAC(secret, "key|" + channel + "|" + name)[:32 hex]
    seal(key, value) = value + HMAC(secret, "mac|" + key + "|" + value)      (32 bytes)
    proof(role, a, b) = HMAC(secret, "proof|" + channel + "|" + role + "|" + a + "|" + b)
"""

from __future__ import annotations

import hashlib
import hmac

from transfer.wire import ArgInvalid

MAC_BYTES = 32
MIN_SECRET_BYTES = 16


class ControlAuth:
    """Key names and seals of one channel under one deployment's secret."""

    def __init__(self, secret: bytes, channel: str) -> None:
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            length = len(secret) if isinstance(secret, bytes) else type(secret).__name__
            raise ArgInvalid("the secret's length", length, f"at least {MIN_SECRET_BYTES} random bytes")
        self._secret, self.channel = secret, channel

    def _mac(self, *parts: bytes) -> bytes:
        return hmac.new(self._secret, b"|".join(parts), hashlib.sha256).digest()

    def key(self, name: str) -> str:
        """The store key for the protocol's `name` ("gen", "g3/bell/7", ...) on this channel."""
        return "dp/" + self._mac(b"key", self.channel.encode(), name.encode()).hex()[:32]

    def proof(self, role: str, first: bytes, second: bytes) -> bytes:
        """The MAC the end playing `role` ("client" | "server") shows over two nonces."""
        return self._mac(b"proof", self.channel.encode(), role.encode(), first, second)

    def proves(self, role: str, first: bytes, second: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(mac, self.proof(role, first, second))

    def seal(self, key: str, value: bytes) -> bytes:
        return value + self._mac(b"mac", key.encode(), value)

    def open(self, key: str, blob: bytes) -> bytes | None:
        """The value sealed under `key`, or None when `blob` was not sealed by a holder of the secret
        for exactly this key."""
        if not isinstance(blob, bytes) or len(blob) < MAC_BYTES:
            return None
        value, mac = blob[:-MAC_BYTES], blob[-MAC_BYTES:]
        return value if hmac.compare_digest(mac, self._mac(b"mac", key.encode(), value)) else None
