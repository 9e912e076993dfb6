"""How one attempt at a request ends without its result, as the driver's retry loop
(`Server._serve_one`) reads it: `Busy` waits and tries again without counting an attempt, `Retry`
tries another pair (both sides already freed what they held), `GiveUp` ends the request as its
kind. Anything else an attempt raises is a bug, and fails the request at once."""

from __future__ import annotations

from distpool.worker.messages import DecodeFailed
from transfer.failure import FailureKind


class Busy(Exception):
    """A pool had no room right now: wait and try again; this does not count as a failed attempt."""


class Retry(Exception):
    """This attempt failed in a way another pair may not (a failed transfer, a dead worker), as
    `kind`; the message says why."""

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class GiveUp(Exception):
    """The request fails as `kind` without another attempt: a damaged envelope (CORRUPT) is a bug to
    see, not bad luck to retry; so is anything a worker says retrying would only repeat."""

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def decode_failure(result: DecodeFailed) -> Exception:
    """What a decode failure raises: corrupt, or a bug on decode's side, is never retried."""
    retry = result.retry and not result.corrupt
    return (Retry if retry else GiveUp)(result.kind, result.reason)
