"""A sender's check of the receiver's destination (an OFFER, or the READY that answers a header)
against the envelope it sends.

An offer pairs where it names this request, agrees on the tokens and the rows, takes chunks as large
as the sender's, and its table, less the pages held at the destination already, pairs with the
envelope's (across TP sizes through the channel's pair). The runs the two tables pair into are the
transfer's plan (`paired_runs`); the receiver computes the same from the header
(`transfer.ends.header_check`). An offer that does not pair is not planned on: the header then waits
for the receiver's answer, and a receiver that refuses it names why.
"""

from __future__ import annotations

import numpy as np

from transfer.ends.end import Job
from transfer.pair import Channel
from transfer.plans import NBYTES, channel_runs, moving_rows
from transfer.wire import OFFER, RETRACTED, ProtocolError, decode_message, offer_key, table_from_bytes


def paired_runs(channel: Channel, job: Job, table: bytes, held: int) -> np.ndarray:
    """The plan's runs from `job`'s envelope, less its first `held` pages (held at the destination
    already: they do not move), into the receiver's `table` (an OFFER's or READY's); the transfer's
    held pages and bytes are set. ValueError / ProtocolError where they do not pair."""
    envelope = job.envelope
    ours = moving_rows(envelope.ranges, held, has_slot=envelope.has_slot)
    theirs = table_from_bytes(table, num_rows=ours.shape[0])
    runs = channel_runs(channel.tp_pair, ours, theirs, num_tokens=envelope.num_tokens, held=held)
    job.transfer.held_pages, job.transfer.num_bytes = held, int(runs[:, NBYTES].sum())
    return runs


def planned_on_offer(channel: Channel, job: Job, chunk_bytes: int) -> tuple[int, np.ndarray] | None:
    """(serial, runs) of the receiver's offer for `job`'s request, where one came and the envelope
    pairs with it (tokens, rows, chunks of `chunk_bytes`, tables), else None. The offer is taken
    either way."""
    envelope = job.envelope
    blob = channel.control.take_offer(offer_key(envelope.request_id))
    if blob is None:
        return None
    try:
        offer = decode_message(blob, expect=(OFFER, RETRACTED), max_bytes=reply_bytes(job))
        if (
            offer["kind"] != OFFER
            or offer["request_id"] != envelope.request_id
            or offer["num_tokens"] != envelope.num_tokens
            or offer["num_rows"] != envelope.ranges.shape[0]
            or offer["max_chunk_bytes"] < chunk_bytes
        ):
            return None
        runs = paired_runs(channel, job, offer["table"], offer["held"])
    except (ProtocolError, ValueError):
        return None
    return offer["serial"], runs


def reply_bytes(job: Job) -> int:
    """The longest OFFER or READY a receiver may send for `job`'s envelope: its table and fields."""
    return job.envelope.ranges.shape[0] * 16 + 1024
