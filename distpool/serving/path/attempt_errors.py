"""How one attempt at a request ends without its result, as the driver's retry loop
(`Server._serve_one`) reads it: `Busy` waits and tries again without counting an attempt, `Retry`
tries another pair (both sides already freed what they held), `GiveUp` ends the request as its
kind. Anything else an attempt raises is a bug, and fails the request at once."""

from __future__ import annotations

from distpool.facts import Facts
from distpool.worker.messages import DecodeFailed
from transfer.wire import FailureKind

NOT_HELD = -1  # the progress of a request the worker does not hold


class Busy(Exception):
    """A pool had no room right now: wait and try again; this does not count as a failed attempt."""


class AdmissionTimedOut(Facts, Busy):
    """No decode worker had room for request `request_id` within the admission timeout,
    `timeout_s`."""

    def __init__(self, request_id: str, timeout_s: float) -> None:
        super().__init__(f"no decode worker had room for {request_id}")
        self.request_id, self.timeout_s = request_id, timeout_s


class Retry(Facts, Exception):
    """This attempt failed in a way another pair may not (a failed transfer, a dead worker), as
    `kind`; the message says why."""

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class NoProgress(Retry):
    """Decode worker `worker` made no progress on request `request_id` for `waited_s` seconds: a
    TIMEOUT. `progress` is where the request stood there (`NOT_HELD`: the worker no longer holds it,
    as when a rank dropped it)."""

    def __init__(self, worker: str, request_id: str, waited_s: float, progress: int) -> None:
        where = "no longer held there" if progress == NOT_HELD else f"stuck at {progress}"
        super().__init__(
            FailureKind.TIMEOUT, f"{worker} made no progress on {request_id} for {waited_s:g} s ({where})"
        )
        self.worker, self.request_id, self.waited_s, self.progress = worker, request_id, waited_s, progress

    @property
    def held(self) -> bool:
        return self.progress != NOT_HELD


class GiveUp(Facts, Exception):
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
