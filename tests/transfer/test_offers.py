"""A receiver offers its destination when it is reserved; a sender that holds the offer sends its
payload right behind the header, with no READY between them. A payload planned on an offer whose
reservation went is received and discarded, and the channel stays in step."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.transfer.conftest import connected_pair
from tests.transfer.transfer_peer import (
    digest,
    envelope_for,
    failure_of,
    make_arena,
    offer_kind,
    wait_for_offer,
)
from transfer import FailureKind, TransferError, TransferOptions, TransferState
from transfer.ends.activity import Activity
from transfer.pair.control import ControlPlane, OfferStore
from transfer.wire import (
    HEADER_DIFFERS,
    NOT_EXPECTED,
    OFFER,
    OFFER_STALE,
    RETRACTED,
    encode_message,
    offer_key,
    table_bytes,
)

ARENA_BYTES = 1 << 20
PAGE_BYTES = 4096


def pages(first: int, count: int, *, stride: int = 2) -> torch.Tensor:
    """`count` pages of the arena, every `stride`-th from page `first` (scattered: many messages)."""
    return torch.tensor([[(first + stride * i) * PAGE_BYTES, PAGE_BYTES] for i in range(count)])


@pytest.fixture
def names(monkeypatch):
    """Every control message name posted in this test, in order."""
    sent: list[str] = []
    original = ControlPlane.send

    def send(self, name, value, **kwargs):
        sent.append(name)
        return original(self, name, value, **kwargs)

    monkeypatch.setattr(ControlPlane, "send", send)
    return sent


def hold(sender, rid: str, blob: bytes) -> None:
    """File `blob` as the sender's offer for `rid`, as the control plane would have."""
    sender.channel.control._offers.put(offer_key(rid), blob)


def test_a_header_planned_on_the_offer_goes_with_its_payload_and_gets_no_ready(pair, names):
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 1), make_arena(ARENA_BYTES, 2)
    src, dst = pages(1, 20), pages(40, 20, stride=3)
    incoming = receiver.expect(envelope_for("a", dst, has_slot=False), dst_arena, deadline_s=5)
    wait_for_offer(sender, "a")
    outgoing = sender.submit(envelope_for("a", src, has_slot=False), src_arena, deadline_s=5)
    outgoing.wait(), incoming.wait()
    assert digest(dst_arena, dst) == digest(src_arena, src)
    assert outgoing.num_bytes == incoming.num_bytes == 20 * PAGE_BYTES
    assert [n.split("/")[0] for n in names] == ["offer", "bell", "status"]  # no reply
    assert offer_kind(sender, "a") is None


def test_a_header_sent_before_the_offer_came_waits_for_ready_and_the_offer_goes(pair, names):
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 3), make_arena(ARENA_BYTES, 4)
    src, dst = pages(1, 8), pages(30, 8)
    outgoing = sender.submit(envelope_for("b", src, has_slot=False), src_arena, deadline_s=5)
    deadline = time.monotonic() + 5
    while "bell/0" not in names:  # the header is out, planned on no offer
        assert time.monotonic() < deadline
        time.sleep(0.005)
    incoming = receiver.expect(envelope_for("b", dst, has_slot=False), dst_arena, deadline_s=5)
    outgoing.wait(), incoming.wait()
    assert digest(dst_arena, dst) == digest(src_arena, src)
    assert [n.split("/")[0] for n in names] == ["bell", "offer", "reply", "status"]
    # The offer came before the READY (the control link keeps order): taken with it, not left over.
    assert offer_kind(sender, "b") is None


def test_an_envelope_that_does_not_pair_with_the_offer_waits_for_the_refusal(pair, names):
    """Another token count than the reservation's: the sender plans on no offer, and the receiver's
    REFUSE names the field, as before offers."""
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 11), make_arena(ARENA_BYTES, 12)
    src, dst = pages(1, 4), pages(30, 4)
    incoming = receiver.expect(envelope_for("g", dst, has_slot=False), dst_arena, deadline_s=5)
    wait_for_offer(sender, "g")
    longer = envelope_for(
        "g", src, has_slot=False, num_tokens=envelope_for("g", src, has_slot=False).num_tokens + 1
    )
    error = failure_of(sender.submit(longer, src_arena, deadline_s=5), 5)
    assert error.cause.problem == HEADER_DIFFERS and "reply/0" in names
    assert failure_of(incoming, 5).kind is FailureKind.REFUSED
    assert sender.channel.healthy and receiver.channel.healthy


def test_an_offer_taken_back_leaves_the_header_to_wait_for_an_answer(pair):
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 5), make_arena(ARENA_BYTES, 6)
    src, dst = pages(1, 4), pages(30, 4)
    incoming = receiver.expect(envelope_for("c", dst, has_slot=False), dst_arena, deadline_s=5)
    wait_for_offer(sender, "c")
    incoming.abort("the request was cancelled on decode")
    assert failure_of(incoming, 5).kind is FailureKind.ABORTED
    wait_for_offer(sender, "c", RETRACTED)  # in place of the OFFER
    error = failure_of(sender.submit(envelope_for("c", src, has_slot=False), src_arena, deadline_s=5), 5)
    assert error.cause.problem == NOT_EXPECTED  # REFUSE after the unexpected wait, as without offers
    assert sender.channel.healthy and receiver.channel.healthy


@pytest.mark.parametrize("then", ["aborted", "expected_again"])
def test_a_payload_planned_on_an_offer_whose_reservation_went_is_discarded(pair, then):
    """The offer crosses the reservation's end: the sender planned on it, the receiver has none (or
    a later one). The payload is received into staging and dropped, STATUS names the refusal, no
    destination byte changes, and the channel goes on."""
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 7), make_arena(ARENA_BYTES, 8)
    src, dst, later_dst = pages(1, 24), pages(60, 24, stride=3), pages(140, 24)
    before = dst_arena.clone()
    first = receiver.expect(envelope_for("d", dst, has_slot=False), dst_arena, deadline_s=5)
    wait_for_offer(sender, "d")
    offered = sender.channel.control.take_offer(
        offer_key("d")
    )  # held back, as if the sender took it just now
    first.abort("the request was cancelled on decode")
    failure_of(first, 5)
    wait_for_offer(sender, "d", RETRACTED)
    later = None
    if then == "expected_again":
        later = receiver.expect(envelope_for("d", later_dst, has_slot=False), dst_arena, deadline_s=5)
        wait_for_offer(sender, "d")
    hold(sender, "d", offered)  # the sender plans on the first offer
    error = failure_of(sender.submit(envelope_for("d", src, has_slot=False), src_arena, deadline_s=5), 5)
    assert isinstance(error, TransferError) and not error.channel_broken
    assert error.kind is FailureKind.REFUSED
    assert error.cause.problem == (NOT_EXPECTED if then == "aborted" else OFFER_STALE)
    assert torch.equal(dst_arena, before)  # discarded: not one byte landed anywhere
    if later is not None:
        assert failure_of(later, 5).kind is FailureKind.REFUSED
    assert sender.channel.healthy and receiver.channel.healthy
    incoming = receiver.expect(envelope_for("e", later_dst, has_slot=False), dst_arena, deadline_s=5)
    sender.submit(envelope_for("e", src, has_slot=False), src_arena, deadline_s=5).wait()
    incoming.wait()
    assert digest(dst_arena, later_dst) == digest(src_arena, src)


def test_a_header_planned_on_an_offer_never_made_costs_the_channel(pair):
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 9), make_arena(ARENA_BYTES, 10)
    src, dst = pages(1, 4), pages(30, 4)
    before = dst_arena.clone()
    forged = encode_message(
        OFFER,
        request_id="f",
        serial=999,
        num_tokens=envelope_for("f", dst, has_slot=False).num_tokens,
        num_rows=4,
        table=table_bytes(dst),
        held=0,
        max_chunk_bytes=1 << 30,
    )
    hold(sender, "f", forged)
    error = failure_of(sender.submit(envelope_for("f", src, has_slot=False), src_arena, deadline_s=3), 10)
    assert error.channel_broken
    assert torch.equal(dst_arena, before)


def test_a_header_planned_on_an_offer_with_chunks_over_the_receivers_limit_costs_the_channel(pair):
    """A payload this end would not take cannot be discarded either (its staging is what the limit
    bounds): the channel breaks, typed, with nothing written, and the receiver's error says why."""
    sender, receiver = pair
    receiver.max_chunk_bytes = 4096  # under the sender's chunks, though its offer said more
    src_arena, dst_arena = make_arena(ARENA_BYTES, 11), make_arena(ARENA_BYTES, 12)
    src, dst = pages(1, 4), pages(30, 4)
    before = dst_arena.clone()
    incoming = receiver.expect(envelope_for("g", dst, has_slot=False), dst_arena, deadline_s=5)
    wait_for_offer(sender, "g")
    error = failure_of(sender.submit(envelope_for("g", src, has_slot=False), src_arena, deadline_s=3), 10)
    assert error.channel_broken
    assert "chunk_bytes" in failure_of(incoming, 10).reason
    assert torch.equal(dst_arena, before)


def test_a_reconnect_offers_again_what_waits_for_its_transfer(pair, names):
    """The sender's offers go with the link: after a reconnect the receiver offers each reservation
    still waiting again, and its header goes with its payload, unanswered."""
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 13), make_arena(ARENA_BYTES, 14)
    src, dst = pages(1, 6), pages(50, 6, stride=3)
    incoming = receiver.expect(envelope_for("h", dst, has_slot=False), dst_arena, deadline_s=20)
    wait_for_offer(sender, "h")
    joining = threading.Thread(target=receiver.connect)
    joining.start()
    sender.connect()
    joining.join()
    wait_for_offer(sender, "h")
    names.clear()
    sender.submit(envelope_for("h", src, has_slot=False), src_arena, deadline_s=5).wait()
    incoming.wait()
    assert digest(dst_arena, dst) == digest(src_arena, src)
    assert [n.split("/")[0] for n in names] == ["bell", "status"]  # planned on the new offer: no reply


def test_the_offer_store_keeps_the_newest_per_name_within_its_count_and_bytes():
    store = OfferStore(max_count=3, max_bytes=100)
    for name in "abc":
        store.put(name, b"x" * 10)
    store.put("a", b"y" * 20)  # replaces a's, and is now the newest
    store.put("d", b"z" * 10)  # four names: b, the oldest, goes
    assert (len(store), store.num_bytes) == (3, 40)
    assert store.peek("b") is None and store.peek("a") == b"y" * 20
    store.put("e", b"w" * 80)  # four names (c goes), then 110 bytes (a goes)
    assert [n for n in "acde" if store.peek(n) is not None] == ["d", "e"] and store.num_bytes == 90
    assert store.take("e") == b"w" * 80 and store.take("e") is None
    assert (len(store), store.num_bytes) == (1, 10)


def test_a_sender_whose_payload_waits_for_the_receiver_counts_as_waiting(names):
    """Planned on an offer, the payload is posted behind the header, but nothing moves until the
    receiver has read the header: meanwhile the sender's worker may compute (its activity is idle),
    as it may while a header waits for READY. Here the receiver is held busy for a while."""
    activity = Activity()
    options = TransferOptions(chunk_bytes=64 << 10, direct_min_bytes=16 << 10)
    sender, receiver = connected_pair("idle", timeout_s=5, options=options, sender_activity=activity)
    try:
        src_arena, dst_arena = make_arena(ARENA_BYTES, 13), make_arena(ARENA_BYTES, 14)
        src, dst = pages(1, 6), pages(30, 6)
        incoming = receiver.expect(envelope_for("h", dst, has_slot=False), dst_arena, deadline_s=5)
        wait_for_offer(sender, "h")
        with receiver.io_lock:  # the receiving worker cannot take the header yet
            outgoing = sender.submit(envelope_for("h", src, has_slot=False), src_arena, deadline_s=5)
            deadline = time.monotonic() + 3
            while "bell/0" not in names or activity.busy():
                assert time.monotonic() < deadline, "the sender counted as busy while nothing moved"
                time.sleep(0.002)
            assert outgoing.state is TransferState.TRANSFERRING
        outgoing.wait(), incoming.wait()
        assert digest(dst_arena, dst) == digest(src_arena, src)
        assert not activity.busy()
    finally:
        sender.close()
        receiver.close()


def test_a_burst_of_reservations_faster_than_the_sender_takes_offers_leaves_the_channel_up(monkeypatch):
    """The sender's control reader takes 20 ms a message, and decode reserves 100 requests at once:
    a peer that takes none of 64 control messages would break the channel, so offers stop while half
    that many wait for it, and the reservations past them go without one (their headers wait for
    READY). Every one still lands."""
    options = TransferOptions(chunk_bytes=64 << 10, direct_min_bytes=16 << 10)
    sender, receiver = connected_pair("burst", timeout_s=10, options=options)
    original = ControlPlane._file

    def slow_file(self, body):
        time.sleep(0.02)
        original(self, body)

    try:
        src_arena, dst_arena = make_arena(ARENA_BYTES, 15), make_arena(ARENA_BYTES, 16)
        monkeypatch.setattr(ControlPlane, "_file", slow_file)
        rids = [f"b{i}" for i in range(100)]
        incoming = [
            receiver.expect(envelope_for(rid, pages(30 + i, 1), has_slot=False), dst_arena, deadline_s=30)
            for i, rid in enumerate(rids)
        ]
        assert receiver.channel.healthy and sender.channel.healthy
        assert 0 < len(receiver.offers) < len(rids)  # some went, the burst's tail did not
        monkeypatch.undo()
        for i, rid in enumerate(rids):
            sender.submit(envelope_for(rid, pages(1 + i % 20, 1), has_slot=False), src_arena, deadline_s=30)
        for i, transfer in enumerate(incoming):
            transfer.wait(30)
            assert digest(dst_arena, pages(30 + i, 1)) == digest(src_arena, pages(1 + i % 20, 1))
    finally:
        sender.close()
        receiver.close()


def test_a_header_refused_on_the_way_that_waits_leaves_no_offer_behind(pair, names):
    """The header went before the offer came, and was refused: the offer, which came before the
    REFUSE, goes with it. Left behind, the request's next attempt would plan on it and be refused
    (or, once the receiver forgot it, cost the channel)."""
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 17), make_arena(ARENA_BYTES, 18)
    src, dst = pages(1, 4), pages(30, 4)
    tokens = envelope_for("k", src, has_slot=False).num_tokens
    outgoing = sender.submit(envelope_for("k", src, has_slot=False, num_tokens=tokens + 1), src_arena)
    deadline = time.monotonic() + 5
    while "bell/0" not in names:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    incoming = receiver.expect(envelope_for("k", dst, has_slot=False), dst_arena, deadline_s=5)
    assert failure_of(outgoing, 5).cause.problem == HEADER_DIFFERS
    assert failure_of(incoming, 5).kind is FailureKind.REFUSED
    assert offer_kind(sender, "k") is None
    incoming = receiver.expect(envelope_for("k", dst, has_slot=False), dst_arena, deadline_s=5)
    wait_for_offer(sender, "k")
    sender.submit(envelope_for("k", src, has_slot=False), src_arena, deadline_s=5).wait(5)
    incoming.wait(5)
    assert digest(dst_arena, dst) == digest(src_arena, src)
