"""Who may steer a channel: a per-deployment secret, unguessable store keys, and a MAC on every message.

The rendezvous store of a channel is reachable by anyone who can reach its port. So every key a
channel uses (rendezvous, hello, bells, replies, ends, statuses, and the prefix Gloo's own keys live
under) is named by an HMAC of the secret: an outsider cannot find, pre-claim or overwrite what it
cannot name. Every value a channel reads is sealed with an HMAC over the value and the full key it
was written under (channel, generation, kind and sequence are all part of that name), so a forged
message and a replay of an authentic one into another key are both refused, counted and dropped.

    key(name)        = "dp/" + HMAC(secret, "key|" + channel + "|" + name)[:32 hex]
    seal(key, value) = value + HMAC(secret, "mac|" + key + "|" + value)      (32 bytes)
"""

from __future__ import annotations

import hashlib
import hmac

MAC_BYTES = 32
MIN_SECRET_BYTES = 16


class ControlAuth:
    """Key names and seals of one channel under one deployment's secret."""

    def __init__(self, secret: bytes, channel: str) -> None:
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a channel secret is at least {MIN_SECRET_BYTES} random bytes")
        self._secret, self.channel = secret, channel

    def _mac(self, *parts: bytes) -> bytes:
        return hmac.new(self._secret, b"|".join(parts), hashlib.sha256).digest()

    def key(self, name: str) -> str:
        """The store key for the protocol's `name` ("gen", "g3/bell/7", ...) on this channel."""
        return "dp/" + self._mac(b"key", self.channel.encode(), name.encode()).hex()[:32]

    def seal(self, key: str, value: bytes) -> bytes:
        return value + self._mac(b"mac", key.encode(), value)

    def open(self, key: str, blob: bytes) -> bytes | None:
        """The value sealed under `key`, or None when `blob` was not sealed by a holder of the secret
        for exactly this key."""
        if not isinstance(blob, bytes) or len(blob) < MAC_BYTES:
            return None
        value, mac = blob[:-MAC_BYTES], blob[-MAC_BYTES:]
        return value if hmac.compare_digest(mac, self._mac(b"mac", key.encode(), value)) else None
