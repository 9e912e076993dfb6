"""A destination that holds its envelope's first pages already (a prefix decode had cached): the
engines move only the other pages and the slot, and a READY that lies about the held count fails
the transfer without a write."""

from __future__ import annotations

import dataclasses

import pytest

import transfer.ends.offers as offers_module
import transfer.ends.receiver as receiver_module
from tests.transfer.test_engine_states import ARENA_BYTES, tables
from tests.transfer.transfer_peer import digest, envelope_for, failure_of, make_arena
from transfer import FailureKind, TransferError, TransferOptions, TransferState
from transfer.wire.protocol import OFFER, READY

HELD = 15  # of the 40 pages


def test_held_pages_are_skipped_on_both_ends_and_the_checksum_covers_the_rest(pair):
    sender, receiver = pair
    sender.options = TransferOptions(chunk_bytes=64 << 10, direct_min_bytes=16 << 10, checksum=True)
    src_arena, dst_arena = make_arena(ARENA_BYTES, 21), make_arena(ARENA_BYTES, 22)
    src, dst = tables(seed=9)
    held_rows, moving_src, moving_dst = (
        dst[1 : 1 + HELD],
        src[[0, *range(1 + HELD, 41)]],
        dst[[0, *range(1 + HELD, 41)]],
    )
    before = digest(dst_arena, held_rows)
    envelope = dataclasses.replace(envelope_for("r", dst, has_slot=True), held_pages=HELD)
    incoming = receiver.expect(envelope, dst_arena, deadline_s=5)
    outgoing = sender.submit(envelope_for("r", src, has_slot=True), src_arena, deadline_s=5)
    outgoing.wait()
    incoming.wait()
    assert incoming.state is outgoing.state is TransferState.SUCCESS
    assert digest(dst_arena, moving_dst) == digest(src_arena, moving_src)
    assert digest(dst_arena, held_rows) == before  # never written
    moved = int(moving_dst[:, 1].sum())
    assert outgoing.num_bytes == incoming.num_bytes == envelope.num_bytes == moved < int(dst[:, 1].sum())
    assert outgoing.held_pages == incoming.held_pages == HELD


@pytest.mark.parametrize("claimed", [41, -1])
def test_a_ready_claiming_pages_the_envelope_lacks_fails_the_transfer(pair, monkeypatch, claimed):
    """A receiver (or whoever forged its offer and reply) cannot make the sender skip the slot or
    send rows that do not pair: the sender plans on no such offer, refuses the READY, and nothing
    is written at the destination."""
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 23), make_arena(ARENA_BYTES, 24)
    src, dst = tables(seed=10)
    real_encode = receiver_module.encode_message

    def lying_encode(kind, **fields):
        if kind in (READY, OFFER):
            fields["held"] = claimed
        return real_encode(kind, **fields)

    monkeypatch.setattr(receiver_module, "encode_message", lying_encode)  # READY
    monkeypatch.setattr(offers_module, "encode_message", lying_encode)  # OFFER
    before = digest(dst_arena, dst)
    incoming = receiver.expect(envelope_for("r", dst, has_slot=True), dst_arena, deadline_s=5)
    outgoing = sender.submit(envelope_for("r", src, has_slot=True), src_arena, deadline_s=5)
    assert failure_of(outgoing).kind is FailureKind.PROTOCOL  # the receiver's READY broke the rules
    with pytest.raises(TransferError):
        incoming.wait()
    assert digest(dst_arena, dst) == before
