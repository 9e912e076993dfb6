"""Whether any of a worker's channel ends is using its channel now, and a wait for none to be.

On a CPU, model work and a transfer share the cores: a worker lets a transfer moving bytes finish
before it prefills or verifies (on a GPU the two would not compete). Each end's `io_lock` (held
while a transfer, a reconnect or a link measurement uses the channel) counts itself here, except
while it waits for its peer, so that wait is an event, not a poll.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class Activity:
    """How many channel ends of one worker hold their `io_lock`; wakes waiters when none does."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0

    def busy(self) -> bool:
        with self._cond:
            return self._busy > 0

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until no end uses its channel; whether none does."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout_s)

    def _enter(self) -> None:
        with self._cond:
            self._busy += 1

    def _leave(self) -> None:
        with self._cond:
            self._busy -= 1
            if self._busy == 0:
                self._cond.notify_all()


class ActivityLock:
    """A channel end's `io_lock`: a plain lock, counted in an `Activity` (if any) while held."""

    def __init__(self, activity: Activity | None = None) -> None:
        self._lock = threading.Lock()
        self._activity = activity

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        taken = self._lock.acquire(blocking, timeout)
        if taken and self._activity is not None:
            self._activity._enter()
        return taken

    def release(self) -> None:
        self._lock.release()
        if self._activity is not None:
            self._activity._leave()

    def locked(self) -> bool:
        return self._lock.locked()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Held, but waiting for the peer (a reply, a reservation): no bytes move, so model work
        need not wait for this end meanwhile."""
        if self._activity is not None:
            self._activity._leave()
        try:
            yield
        finally:
            if self._activity is not None:
                self._activity._enter()

    def __enter__(self) -> ActivityLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
