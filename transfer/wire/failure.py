"""`FailureKind`: what kind of failure ended a transfer or a request, read instead of its wording.

The kind travels beside a human sentence everywhere a failure does: in `TransferError`, in the
transfer protocol's REFUSE / ABORT / STATUS messages (by value), in prefill's and decode's
per-request results, and in the driver's outcome. Metrics tag by it, the driver decides retries
from it and the run summary counts failures by it. The set is fixed: a Prometheus tag's values
stay few. It lives at the lowest layer that raises one of them (the transfer engine), so that
every layer above reads the same vocabulary.
"""

from __future__ import annotations

import enum


class FailureKind(str, enum.Enum):
    # the transfer path
    CORRUPT = "corrupt"  # bytes arrived wrong: a checksum mismatch, or decode's verification
    TIMEOUT = "timeout"  # a deadline passed (nothing came, or a wait on the link never ended)
    PEER_LOST = "peer_lost"  # the link or the peer went away: a broken, closed or missing channel
    ABORTED = "aborted"  # one end gave the transfer up on purpose: an abort, a cancel, a shutdown
    REFUSED = "refused"  # the receiver refused the header: no reservation for it, or one it does not fit
    PROTOCOL = "protocol"  # the peer sent what the protocol does not allow; the channel is out of step
    # the pools and the driver
    NO_ROOM = "no_room"  # a pool had no room for the request now (prefill busy, reservation refused)
    NOT_ADMITTED = "not_admitted"  # no pool took the request within the admission timeout
    WORKER_LOST = "worker_lost"  # a worker died or stopped answering while it held the request
    BAD_REQUEST = "bad_request"  # the request itself cannot be served (a duplicate id, no envelope fits)
    INTERNAL = "internal"  # a bug: an exception nobody expected (retrying would only repeat it)

    def __str__(self) -> str:  # a metric tag, a JSON key and a summary row all read the value
        return self.value


WIRE_VALUES = frozenset(kind.value for kind in FailureKind)  # what a control message may carry
