"""A receiver's check of a transfer's header against the reservation it names.

The header must agree with the reservation on the protocol version, the sequence number the bell
rang for, the tokens and the rows; its chunk sizes must stay within the receiver's limits; and its
table, less the pages held at the destination already, must pair with the reservation's (across TP
sizes each row must have the source shard's unit size). A mismatch is a `HeaderRefused` naming the
problem; nothing is written and nothing waited for. The runs the two tables pair into are the
transfer's plan (`header_runs`), which a payload planned on an offer is also discarded by.
"""

from __future__ import annotations

import time

import numpy as np

from distpool.memory.envelope import Envelope
from transfer.ends.end import Job
from transfer.plans import NBYTES, TpPair, channel_runs
from transfer.wire import (
    CHUNK_LIMITS,
    GIVEN_UP,
    HEADER_DIFFERS,
    LAYOUT,
    PROTOCOL_VERSION,
    FailureKind,
    HeaderRefused,
    ProtocolError,
    table_from_bytes,
)


def header_runs(tp_pair: TpPair | None, expected: Envelope, header: dict) -> np.ndarray:
    """The runs of a transfer from the header's table into `expected` (ValueError, ProtocolError
    when the tables do not pair)."""
    num_rows = len(header["table"]) // 16
    return channel_runs(
        tp_pair,
        expected.moving_of(table_from_bytes(header["table"], num_rows=num_rows)),
        expected.moving,
        num_tokens=expected.num_tokens,
        held=expected.held_pages,
    )


def out_of_limits(header: dict, max_chunk_bytes: int) -> str | None:
    """Why the header's chunk sizes are out of the receiver's limits, or None."""
    if 0 < header["chunk_bytes"] <= max_chunk_bytes and header["direct_min_bytes"] > 0:
        return None
    return (
        f"chunk_bytes {header['chunk_bytes']} and direct_min_bytes {header['direct_min_bytes']} "
        f"must be in (0, {max_chunk_bytes}] and > 0"
    )


def check_header(
    job: Job, seq: int, header: dict, tp_pair: TpPair | None, max_chunk_bytes: int
) -> HeaderRefused | None:
    """Why `header` (of transfer `seq`) cannot fill `job`'s reservation, or None if it can: then
    `job.runs` is the plan and the transfer's `num_bytes` its bytes (across TP: this channel's
    share)."""
    expected, transfer = job.envelope, job.transfer
    if transfer.abort_reason is not None:
        return HeaderRefused(FailureKind.ABORTED, GIVEN_UP, transfer.abort_reason)
    if time.monotonic() >= transfer.deadline:
        reason = "the reservation's deadline passed before the transfer could start"
        return HeaderRefused(FailureKind.TIMEOUT, GIVEN_UP, reason)
    num_rows = len(header["table"]) // 16
    for field, mine, theirs in (
        ("protocol version", PROTOCOL_VERSION, header["version"]),
        ("transfer sequence number", seq, header["seq"]),
        ("number of tokens", expected.num_tokens, header["num_tokens"]),
        ("number of byte ranges (slot and pages)", expected.ranges.shape[0], num_rows),
    ):
        if mine != theirs:
            detail = f"{field} differs: reserved {mine!r}, sender has {theirs!r}"
            return HeaderRefused(
                FailureKind.REFUSED, HEADER_DIFFERS, detail, field=field, mine=mine, theirs=theirs
            )
    if (limits := out_of_limits(header, max_chunk_bytes)) is not None:
        return HeaderRefused(FailureKind.REFUSED, CHUNK_LIMITS, limits)
    try:
        runs = header_runs(tp_pair, expected, header)
    except (ProtocolError, ValueError) as exc:
        return HeaderRefused(FailureKind.REFUSED, LAYOUT, str(exc), cause=exc)
    job.runs = runs
    transfer.num_bytes = int(runs[:, NBYTES].sum())
    return None
