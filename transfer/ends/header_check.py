"""Whether a sender's HEADER can fill a reservation on the receiver, and the runs it moves if it can.

A pure step of the receiver's protocol (`transfer.ends.receiver`): it reads the decoded header and the
reserved envelope, writes nothing and waits for nothing. The header has to agree with the
reservation on the protocol version, the transfer's sequence number, the number of tokens and of
rows; its chunk sizes must stay within this receiver's limits; and its table, less the pages held
here already, must pair with ours (across TP sizes each row must have the source shard's unit
size). Where bytes go is computed from the receiver's own ranges alone; the header only has to
agree.
"""

from __future__ import annotations

import numpy as np

from distpool.memory.envelope import Envelope
from transfer.plans import TpPair, channel_runs
from transfer.wire import PROTOCOL_VERSION, FailureKind, ProtocolError, table_from_bytes

Refusal = tuple[FailureKind, str]  # why a header is refused, or a transfer failed: kind, reason


def header_runs(
    expected: Envelope, header: dict, *, seq: int, max_chunk_bytes: int, tp_pair: TpPair | None
) -> tuple[np.ndarray | None, Refusal | None]:
    """The runs (m, 3) the transfer `header` announces would move into the reservation `expected`,
    or why the header cannot fill it (then no runs). `seq` is the transfer the bell rang for."""
    num_rows = len(header["table"]) // 16
    checks = [
        ("protocol version", PROTOCOL_VERSION, header["version"]),
        ("transfer sequence number", seq, header["seq"]),
        ("number of tokens", expected.num_tokens, header["num_tokens"]),
        ("number of byte ranges (slot and pages)", expected.ranges.shape[0], num_rows),
    ]
    for what, mine, theirs in checks:
        if mine != theirs:
            return None, (FailureKind.REFUSED, f"{what} differs: reserved {mine!r}, sender has {theirs!r}")
    if not 0 < header["chunk_bytes"] <= max_chunk_bytes or header["direct_min_bytes"] <= 0:
        return None, (
            FailureKind.REFUSED,
            f"chunk_bytes {header['chunk_bytes']} and direct_min_bytes {header['direct_min_bytes']} must "
            f"be in (0, {max_chunk_bytes}] and > 0",
        )
    try:
        source = expected.moving_of(table_from_bytes(header["table"], num_rows=num_rows))
        runs = channel_runs(
            tp_pair,
            source,
            expected.moving,
            num_tokens=expected.num_tokens,
            held=expected.held_pages,
        )
    except (ProtocolError, ValueError) as exc:
        return None, (FailureKind.REFUSED, str(exc))
    return runs, None
