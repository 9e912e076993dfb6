"""The control plane of one channel generation: small messages through the rendezvous store.

Payload moves over the process group; headers, replies, ends and statuses move here (keys in
`transfer.protocol`). A store wait can time out without harming anything, and a garbled message
costs a refusal, not the channel. Failures are classified by exception type: `DistStoreError` is a
wait that timed out (nothing is wrong), `DistNetworkError` (or any other error) a store that is gone.

The receiver blocks on the next bell through a second client of the store (`bell_store`): a TCPStore
client runs one operation at a time, and a teardown must still reach the store while a wait blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch.distributed as dist

from transfer.errors import ChannelError
from transfer.protocol import TEARDOWN_MARK, bell_key
from transfer.rendezvous import delta


class ControlPlane:
    """Store keys of one channel generation. `on_gone(reason)` runs when the store is found dead."""

    def __init__(
        self,
        store: dist.Store,
        *,
        name: str,
        on_gone: Callable[[str], None],
        bell_store: dist.Store | None = None,
    ) -> None:
        self.store, self.bell_store, self.name, self._on_gone = store, bell_store, name, on_gone

    def put_once(self, key: str, value: bytes) -> bytes:
        """Set `key` unless it is already set; returns what the key holds now (`value` if we won)."""
        try:
            return self.store.compare_set(key, "", value)
        except Exception as exc:
            raise self._gone(exc) from None

    def put_soon(self, key: str, value: bytes) -> None:
        """Best effort, on a daemon thread: `put_once` for news the peer may never read; nothing
        waits for a store whose host may have hung."""

        def put() -> None:
            try:
                self.store.compare_set(key, "", value)
            except Exception:  # the store went with its host: nobody is left to tell
                pass

        threading.Thread(target=put, name=f"put-{self.name}", daemon=True).start()

    def wait_value(self, key: str, timeout_s: float, *, store: dist.Store | None = None) -> bytes | None:
        """Block until `key` is set (its value) or `timeout_s` passes (None)."""
        store = store or self.store
        try:
            # A get blocks until the key exists: one round trip where wait + get take two.
            store.set_timeout(delta(timeout_s))
            return store.get(key)
        except dist.DistStoreError:  # the wait timed out; the store is fine
            return None
        except Exception as exc:  # DistNetworkError and friends: the store is gone
            raise self._gone(exc) from None

    def wait_bell(self, seq: int, timeout_s: float) -> bytes | None:
        """Receiver: the header rung as bell `seq`, None on timeout; a teardown marker comes back as is."""
        if self.bell_store is None:
            raise ChannelError(f"channel {self.name}: only the receiving end waits for bells")
        return self.wait_value(bell_key(seq), timeout_s, store=self.bell_store)

    def wake(self, seq: int, reason: str) -> None:
        """Put the teardown marker on bell `seq`, waking a receiver blocked on it (best effort)."""
        try:
            self.store.compare_set(bell_key(seq), "", TEARDOWN_MARK + reason.encode())
        except Exception:  # the store may be gone with its host
            pass

    def discard(self, *keys: str) -> None:
        """Delete keys a finished transfer left; a store that is gone marks the channel broken."""
        try:
            for key in keys:
                self.store.delete_key(key)
        except Exception as exc:
            self._gone(exc)

    def _gone(self, exc: Exception) -> ChannelError:
        reason = f"store unreachable: {str(exc).splitlines()[0][:200]}"
        self._on_gone(reason)
        return ChannelError(f"channel {self.name}: {reason}")
