"""How one attempt at a request ends without its result, as the driver's retry loop
(`Server._serve_one`) reads it: `Busy` waits and tries again without counting an attempt, `Retry`
tries another pair (both sides already freed what they held), `GiveUp` ends the request as its
kind. Anything else an attempt raises is a bug, and fails the request at once."""

from __future__ import annotations

from distpool.worker.messages import DecodeFailed
from transfer.wire import FailureKind


class Busy(Exception):
    """A pool had no room right now: wait and try again; this does not count as a failed attempt."""


class Retry(Exception):
    """This attempt failed in a way another pair may not (a failed transfer, a dead worker), as
    `kind`; the message says why."""

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class GiveUp(Exception):
    """The request fails as `kind` without another attempt: an envelope damaged inside decode's pool
    (CORRUPT at release) is a bug to see, not bad luck to retry; so is anything a worker says
    retrying would only repeat."""

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def decode_failure(result: DecodeFailed) -> Exception:
    """What a decode failure raises: Retry where decode says another attempt may succeed (an
    envelope damaged on its way, as a checksum mismatch is), else GiveUp (damaged in decode's own
    pool, or a bug on decode's side)."""
    return (Retry if result.retry else GiveUp)(result.kind, result.reason)
