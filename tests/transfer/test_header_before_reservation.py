"""A header may reach the receiver before its destination is reserved (the driver reserves while
prefill computes): it waits for the reservation, or is refused at once when the reservation is."""

from __future__ import annotations

import time

import torch

from tests.transfer.transfer_peer import digest, envelope_for, failure_of, fragmented_ranges, make_arena
from transfer import FailureKind
from transfer.wire import TURNED_AWAY

ARENA_BYTES = 1 << 20
PAGE_BYTES = 4096
WAIT_FOR_RESERVATION_S = 60.0  # far past anything the scenarios wait: only an event ends the wait


def ranges(seed: int) -> torch.Tensor:
    return fragmented_ranges(
        seed=seed,
        num_pages=16,
        page_bytes=PAGE_BYTES,
        arena_pages=ARENA_BYTES // PAGE_BYTES,
        fragmentation=1.0,
    )


def wait_until_the_header_waits(receiver, timeout_s: float = 30.0) -> None:
    """The receiver holds its channel while a header waits for its reservation."""
    deadline = time.monotonic() + timeout_s
    while not receiver.io_lock.locked():
        assert time.monotonic() < deadline, "the header never reached the receiver"
        time.sleep(0.005)


def test_a_header_that_comes_before_its_reservation_lands_once_reserved(pair):
    sender, receiver = pair
    receiver.unexpected_wait_s = WAIT_FOR_RESERVATION_S
    src, dst = ranges(1), ranges(2)
    src_arena, dst_arena = make_arena(ARENA_BYTES, 3), make_arena(ARENA_BYTES, 4)
    outgoing = sender.submit(envelope_for("early", src, has_slot=False), src_arena, deadline_s=30)
    wait_until_the_header_waits(receiver)
    incoming = receiver.expect(envelope_for("early", dst, has_slot=False), dst_arena, deadline_s=30)
    outgoing.wait()
    incoming.wait()
    assert digest(dst_arena, dst) == digest(src_arena, src)


def test_a_refused_reservation_refuses_the_waiting_header_at_once(pair):
    sender, receiver = pair
    receiver.unexpected_wait_s = WAIT_FOR_RESERVATION_S
    src = ranges(5)
    outgoing = sender.submit(
        envelope_for("refused", src, has_slot=False), make_arena(ARENA_BYTES, 6), deadline_s=30
    )
    wait_until_the_header_waits(receiver)
    receiver.refuse("refused", FailureKind.NO_ROOM, "reservation refused: no room")
    assert failure_of(outgoing).kind is FailureKind.NO_ROOM  # an event, not the minute's wait
    assert outgoing.error.cause.problem == TURNED_AWAY


def test_a_refusal_is_read_once_and_a_later_reservation_clears_it(pair):
    sender, receiver = pair
    receiver.unexpected_wait_s = WAIT_FOR_RESERVATION_S
    src, dst = ranges(7), ranges(8)
    src_arena, dst_arena = make_arena(ARENA_BYTES, 9), make_arena(ARENA_BYTES, 10)
    envelope = envelope_for("again", src, has_slot=False)
    receiver.refuse("again", FailureKind.ABORTED, "given up")  # before its header comes: refused when it does
    assert failure_of(sender.submit(envelope, src_arena, deadline_s=30)).kind is FailureKind.ABORTED
    # The next attempt of the same request: its header waits for the reservation again.
    outgoing = sender.submit(envelope, src_arena, deadline_s=30)
    wait_until_the_header_waits(receiver)
    incoming = receiver.expect(envelope_for("again", dst, has_slot=False), dst_arena, deadline_s=30)
    outgoing.wait()
    incoming.wait()
    assert digest(dst_arena, dst) == digest(src_arena, src)
    # A refusal forgotten (None) refuses nothing: the header waits for its reservation.
    receiver.refuse("later", FailureKind.ABORTED, "given up")
    receiver.refuse("later", None)
    outgoing = sender.submit(envelope_for("later", src, has_slot=False), src_arena, deadline_s=30)
    wait_until_the_header_waits(receiver)
    incoming = receiver.expect(envelope_for("later", dst, has_slot=False), dst_arena, deadline_s=30)
    outgoing.wait()
    incoming.wait()
