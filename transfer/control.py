"""The control plane of one channel generation: small messages through the rendezvous store.

Payload moves over the process group; headers, replies, ends and statuses move here (keys in
`transfer.protocol`). A store wait can time out without harming anything, and a garbled message
costs a refusal, not the channel. Failures are classified by exception type: `DistStoreError` is a
wait that timed out (nothing is wrong), `DistNetworkError` (or any other error) a store that is gone.

The receiver blocks on the next bell through a second client of the store (`bell_store`): a TCPStore
client runs one operation at a time, and a teardown must still reach the store while a wait blocks.

Every key is named and every value sealed by `transfer.auth` under the deployment's secret. A value
that does not open (forged, replayed from another key, garbage) is counted in `rejected` and
ignored, and the wait goes on: nothing an outsider writes is acted on, and it cannot hold a key
against the legitimate writer either (`put_once` displaces it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from transfer.auth import ControlAuth
from transfer.errors import ChannelError
from transfer.protocol import TEARDOWN_MARK, bell_key
from transfer.rendezvous import delta

FORGED_POLL_S = 0.01  # how often a key an outsider wrote is read again, waiting for the real value


class ControlPlane:
    """Store keys of one channel generation. `on_gone(reason)` runs when the store is found dead.
    Methods take the protocol's key names ("bell/3"); the store sees only their sealed forms."""

    def __init__(
        self,
        store: dist.Store,
        *,
        name: str,
        auth: ControlAuth,
        generation: int,
        on_gone: Callable[[str], None],
        bell_store: dist.Store | None = None,
    ) -> None:
        self.store, self.bell_store, self.name, self._on_gone = store, bell_store, name, on_gone
        self.auth, self.generation = auth, generation
        self.rejected = 0  # values that did not open: forged, replayed or garbage

    def _key(self, key: str) -> str:
        return self.auth.key(f"g{self.generation}/{key}")

    def put_once(self, key: str, value: bytes) -> bytes:
        """Set `key` unless a legitimate writer already did; returns the value the key holds now
        (`value` if we won). A value that does not open is displaced, not respected."""
        stored_key = self._key(key)
        sealed = self.auth.seal(stored_key, value)
        try:
            current = self.store.compare_set(stored_key, "", sealed)
            for _ in range(8):  # each round displaces one forged value an outsider raced in
                if current == sealed:
                    return value
                opened = self.auth.open(stored_key, current)
                if opened is not None:
                    return opened
                self.rejected += 1
                current = self.store.compare_set(stored_key, current, sealed)
        except Exception as exc:
            raise self._gone(exc) from None
        raise ChannelError(f"channel {self.name}: key {key} is being fought over; giving up")

    def put_soon(self, key: str, value: bytes) -> None:
        """Best effort, on a daemon thread: `put_once` for news the peer may never read; nothing
        waits for a store whose host may have hung."""

        stored_key = self._key(key)
        sealed = self.auth.seal(stored_key, value)

        def put() -> None:
            try:
                self.store.compare_set(stored_key, "", sealed)
            except Exception:  # the store went with its host: nobody is left to tell
                pass

        threading.Thread(target=put, name=f"put-{self.name}", daemon=True).start()

    def wait_value(self, key: str, timeout_s: float, *, store: dist.Store | None = None) -> bytes | None:
        """Block until `key` holds an authentic value (returned) or `timeout_s` passes (None)."""
        store = store or self.store
        stored_key = self._key(key)
        deadline, rejected = time.monotonic() + timeout_s, None
        while True:
            try:
                # A get blocks until the key exists: one round trip where wait + get take two.
                store.set_timeout(delta(deadline - time.monotonic()))
                blob = store.get(stored_key)
            except dist.DistStoreError:  # the wait timed out; the store is fine
                return None
            except Exception as exc:  # DistNetworkError and friends: the store is gone
                raise self._gone(exc) from None
            value = self.auth.open(stored_key, blob)
            if value is not None:
                return value
            if blob != rejected:  # not ours: drop it and keep waiting; the real writer displaces it
                self.rejected, rejected = self.rejected + 1, blob
            if time.monotonic() >= deadline:
                return None
            time.sleep(FORGED_POLL_S)

    def wait_bell(self, seq: int, timeout_s: float) -> bytes | None:
        """Receiver: the header rung as bell `seq`, None on timeout; a teardown marker comes back as is."""
        if self.bell_store is None:
            raise ChannelError(f"channel {self.name}: only the receiving end waits for bells")
        return self.wait_value(bell_key(seq), timeout_s, store=self.bell_store)

    def wake(self, seq: int, reason: str) -> None:
        """Put the teardown marker on bell `seq`, waking a receiver blocked on it (best effort)."""
        try:
            self.put_once(bell_key(seq), TEARDOWN_MARK + reason.encode())
        except Exception:  # the store may be gone with its host
            pass

    def discard(self, *keys: str) -> None:
        """Delete keys a finished transfer left; a store that is gone marks the channel broken."""
        try:
            for key in keys:
                self.store.delete_key(self._key(key))
        except Exception as exc:
            self._gone(exc)

    def _gone(self, exc: Exception) -> ChannelError:
        reason = f"store unreachable: {str(exc).splitlines()[0][:200]}"
        self._on_gone(reason)
        return ChannelError(f"channel {self.name}: {reason}")
