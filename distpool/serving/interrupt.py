"""SIGTERM ends a run as Ctrl-C does: what `timeout`, Kubernetes and `ray job stop` send is an
interrupt, not a reason to lose the results of the requests that ended.

Within a run, SIGTERM raises `Terminated`, a KeyboardInterrupt, in the main thread: the run writes
its summary, `--json` and `--outputs` of what ended by then, and exits 143 (128 + SIGTERM) where
Ctrl-C exits 130. `ray.init` installs its own SIGTERM handler (an immediate exit) in the driver, so
the run installs this one again once Ray has started.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

INTERRUPTED_STATUS = 128 + signal.SIGINT  # 130: the shell's status of a Ctrl-C
TERMINATED_STATUS = 128 + signal.SIGTERM  # 143


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: handled wherever Ctrl-C is, and the exit status says which it was."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def catch_sigterm() -> signal.Handlers | object | None:
    """From now on SIGTERM raises `Terminated` in the main thread; returns the handler it replaced
    (for `restore_sigterm`). Outside the main thread (where no handler can be set), nothing."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def restore_sigterm(previous: signal.Handlers | object | None) -> None:
    """Put back the handler `catch_sigterm` replaced."""
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


def exit_status_of(interrupt: KeyboardInterrupt) -> int:
    """130 after Ctrl-C, 143 after SIGTERM."""
    return TERMINATED_STATUS if isinstance(interrupt, Terminated) else INTERRUPTED_STATUS
