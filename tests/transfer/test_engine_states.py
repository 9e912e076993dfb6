"""Both engines in one process (two channels' ends on threads): states, refusals, aborts, deadlines."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

import transfer.ends.receive_pipeline as receive_pipeline_module
import transfer.ends.send_pipeline as send_pipeline_module
from distpool.memory.envelope import Envelope
from distpool.memory.pool import EnvelopeInvalid, HeldPagesInvalid, RequestIdInvalid
from tests.transfer.transfer_peer import (
    Ledger,
    digest,
    digest_outside,
    envelope_for,
    failure_of,
    fragmented_ranges,
    make_arena,
)
from transfer import (
    AlreadyExpected,
    ArgInvalid,
    FailureKind,
    Transfer,
    TransferError,
    TransferOptions,
    TransferState,
)
from transfer.plans import PAST_ARENA, RangesRefused
from transfer.wire import HEADER_DIFFERS, NOT_EXPECTED

ARENA_BYTES = 4 << 20
PAGE_BYTES, SLOT_BYTES = 4096, 12288


def tables(seed: int, num_pages: int = 40, fragmentation: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    kw = dict(
        num_pages=num_pages,
        page_bytes=PAGE_BYTES,
        arena_pages=(ARENA_BYTES - SLOT_BYTES) // PAGE_BYTES,
        fragmentation=fragmentation,
        slot_bytes=SLOT_BYTES,
    )
    return fragmented_ranges(seed=seed, **kw), fragmented_ranges(seed=seed + 1000, **kw)


def round_trip(sender, receiver, rid: str, source, destination, *, has_slot: bool) -> None:
    """Move one envelope, (arena, ranges) to (arena, ranges), and check it arrived byte-identical."""
    (src_arena, src), (dst_arena, dst) = source, destination
    incoming = receiver.expect(envelope_for(rid, dst, has_slot=has_slot), dst_arena, deadline_s=5)
    sender.submit(envelope_for(rid, src, has_slot=has_slot), src_arena, deadline_s=5).wait()
    incoming.wait()
    assert digest(dst_arena, dst) == digest(src_arena, src)


def test_states_move_waiting_transferring_success(pair):
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 1), make_arena(ARENA_BYTES, 2)
    src, dst = tables(seed=1)
    outside_before = digest_outside(dst_arena, dst)
    seen: list[TransferState] = []
    incoming = receiver.expect(
        envelope_for("a", dst, has_slot=True),
        dst_arena,
        deadline_s=5,
        on_chunk=lambda t, k: seen.append(t.state),
    )
    assert incoming.state is TransferState.WAITING
    outgoing = sender.submit(
        envelope_for("a", src, has_slot=True),
        src_arena,
        deadline_s=5,
        on_chunk=lambda t, k: seen.append(t.state),
    )
    assert outgoing.wait() is outgoing and incoming.wait() is incoming
    assert outgoing.state is incoming.state is TransferState.SUCCESS
    assert outgoing.error is None and incoming.error is None
    # 40 pages + a slot in 64 KiB chunks: both sides saw every chunk while TRANSFERRING.
    num_chunks = -(-(40 * PAGE_BYTES + SLOT_BYTES) // (64 << 10))
    assert seen == [TransferState.TRANSFERRING] * (2 * num_chunks)
    assert incoming.num_chunks_done == outgoing.num_chunks_done == num_chunks
    assert digest(dst_arena, dst) == digest(src_arena, src)
    assert digest_outside(dst_arena, dst) == outside_before


def test_a_header_that_does_not_fit_the_reservation_is_refused_before_any_write(pair):
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 3), make_arena(ARENA_BYTES, 4)
    src, dst = tables(seed=2)
    before = digest(dst_arena, dst)
    incoming = receiver.expect(envelope_for("b", dst, has_slot=True, num_tokens=640), dst_arena, deadline_s=5)
    outgoing = sender.submit(envelope_for("b", src, has_slot=True, num_tokens=630), src_arena, deadline_s=5)
    for transfer in (outgoing, incoming):
        assert failure_of(transfer).kind is FailureKind.REFUSED
        assert transfer.state is TransferState.FAILED
        assert not transfer.error.channel_broken
        assert transfer.error.cause.problem == HEADER_DIFFERS  # both ends: what REFUSE named
    refused = incoming.error.cause  # the receiver's own, with the facts
    assert (refused.field, refused.mine, refused.theirs) == ("number of tokens", 640, 630)
    assert digest(dst_arena, dst) == before
    assert sender.channel.healthy and receiver.channel.healthy


def test_a_transfer_nobody_expects_is_refused_quickly(pair):
    sender, _ = pair
    src = tables(seed=3)[0]
    started = time.monotonic()
    outgoing = sender.submit(
        envelope_for("nobody", src, has_slot=True), make_arena(ARENA_BYTES, 5), deadline_s=60
    )
    assert failure_of(outgoing).kind is FailureKind.REFUSED  # not the deadline
    assert outgoing.error.cause.problem == NOT_EXPECTED
    assert time.monotonic() - started < 30


def test_an_expectation_fails_at_its_deadline_and_the_channel_stays_usable(pair):
    sender, receiver = pair
    src, dst = tables(seed=4)
    dst_arena = make_arena(ARENA_BYTES, 6)
    started = time.monotonic()
    lonely = receiver.expect(envelope_for("late", dst, has_slot=True), dst_arena, deadline_s=0.6)
    assert failure_of(lonely).kind is FailureKind.TIMEOUT
    assert time.monotonic() - started < 30
    assert lonely.state is TransferState.FAILED
    # The same request id can be expected again, and this time it arrives.
    src_arena = make_arena(ARENA_BYTES, 7)
    round_trip(sender, receiver, "late", (src_arena, src), (dst_arena, dst), has_slot=True)


def test_aborting_a_waiting_expectation_fails_it_at_once(pair):
    _, receiver = pair
    dst = tables(seed=5)[1]
    transfer = receiver.expect(
        envelope_for("x", dst, has_slot=True), make_arena(ARENA_BYTES, 8), deadline_s=30
    )
    transfer.abort("decode worker is shutting down")
    assert failure_of(transfer, timeout_s=1).kind is FailureKind.ABORTED


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_abort_mid_transfer_from_either_side_fails_both_and_keeps_the_channel(pair, side):
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 9), make_arena(ARENA_BYTES, 10)
    src, dst = tables(seed=6, num_pages=200)
    ledger = Ledger(ARENA_BYTES)
    ledger.reserve("ab", dst)
    ledger.pin("ab")

    def abort_after_chunk_1(transfer, index):
        if index == 1:
            transfer.abort(f"{side} gave up")

    hooks = {side: abort_after_chunk_1}
    incoming = receiver.expect(
        envelope_for("ab", dst, has_slot=True), dst_arena, deadline_s=5, on_chunk=hooks.get("receiver")
    )
    outgoing = sender.submit(
        envelope_for("ab", src, has_slot=True), src_arena, deadline_s=5, on_chunk=hooks.get("sender")
    )
    for transfer in (outgoing, incoming):
        assert failure_of(transfer, timeout_s=5).kind is FailureKind.ABORTED
        assert not transfer.error.channel_broken
    ledger.unpin("ab")
    ledger.release("ab")
    ledger.check_invariants()
    assert ledger.free_bytes == ARENA_BYTES
    # The next transfer on the same channel goes through.
    round_trip(sender, receiver, "next", (src_arena, src), (dst_arena, dst), has_slot=True)


def test_checksum_catches_bytes_corrupted_on_landing(pair, monkeypatch):
    sender, receiver = pair
    sender.options = TransferOptions(chunk_bytes=64 << 10, direct_min_bytes=1 << 30, checksum=True)
    src_arena, dst_arena = make_arena(ARENA_BYTES, 11), make_arena(ARENA_BYTES, 12)
    src, dst = tables(seed=7)
    incoming = receiver.expect(envelope_for("ok", dst, has_slot=True), dst_arena, deadline_s=5)
    sender.submit(envelope_for("ok", src, has_slot=True), src_arena, deadline_s=5).wait()
    incoming.wait()

    real_scatter = receive_pipeline_module.scatter

    def flipping_scatter(buffer, offsets, nbytes, arena):
        real_scatter(buffer, offsets, nbytes, arena)
        arena[int(offsets[0])] ^= 0xFF

    monkeypatch.setattr(receive_pipeline_module, "scatter", flipping_scatter)
    incoming = receiver.expect(envelope_for("bad", dst, has_slot=True), dst_arena, deadline_s=5)
    outgoing = sender.submit(envelope_for("bad", src, has_slot=True), src_arena, deadline_s=5)
    for transfer in (outgoing, incoming):
        assert failure_of(transfer).kind is FailureKind.CORRUPT


@pytest.mark.parametrize("scattered", ["source", "destination"])
def test_the_side_whose_pages_are_contiguous_copies_nothing(pair, monkeypatch, scattered):
    """Scattered pages on one side only: that side stages, the other moves the bytes in place."""
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 15), make_arena(ARENA_BYTES, 16)
    kw = dict(num_pages=60, page_bytes=PAGE_BYTES, arena_pages=ARENA_BYTES // PAGE_BYTES)
    spread = fragmented_ranges(seed=21, fragmentation=1.0, **kw)
    packed = fragmented_ranges(seed=22, fragmentation=0.0, **kw)
    src, dst = (spread, packed) if scattered == "source" else (packed, spread)
    copied = {"gather": 0, "scatter": 0}

    def counting(name, real):
        def copy(*args):
            copied[name] += int(args[2].sum())
            real(*args)

        return copy

    monkeypatch.setattr(send_pipeline_module, "gather", counting("gather", send_pipeline_module.gather))
    monkeypatch.setattr(
        receive_pipeline_module, "scatter", counting("scatter", receive_pipeline_module.scatter)
    )
    round_trip(sender, receiver, "one-sided", (src_arena, src), (dst_arena, dst), has_slot=False)
    staged_side, in_place_side = ("gather", "scatter") if scattered == "source" else ("scatter", "gather")
    assert copied[staged_side] == 60 * PAGE_BYTES
    assert copied[in_place_side] == 0


def test_queued_transfers_arrive_in_any_expectation_order(pair):
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 13), make_arena(ARENA_BYTES, 14)
    # Eight envelopes of 8 pages each, disjoint on both sides.
    order = torch.randperm(128, generator=torch.Generator().manual_seed(3))
    src_tables = [
        torch.stack([order[i * 8 : i * 8 + 8] * PAGE_BYTES, torch.full((8,), PAGE_BYTES)], 1)
        for i in range(8)
    ]
    dst_tables = [
        torch.stack([(127 - order[i * 8 : i * 8 + 8]) * PAGE_BYTES, torch.full((8,), PAGE_BYTES)], 1)
        for i in range(8)
    ]
    outgoing = [
        sender.submit(envelope_for(f"q{i}", src_tables[i], has_slot=False), src_arena, deadline_s=10)
        for i in range(8)
    ]
    incoming = [
        receiver.expect(envelope_for(f"q{i}", dst_tables[i], has_slot=False), dst_arena, deadline_s=10)
        for i in reversed(range(8))
    ]
    for transfer in outgoing + incoming:
        transfer.wait()
    for i in range(8):
        assert digest(dst_arena, dst_tables[i]) == digest(src_arena, src_tables[i])


def test_a_queued_transfer_on_a_broken_channel_fails_at_its_deadline(pair):
    sender, _ = pair
    sender.channel.mark_broken("test: link down")
    src = tables(seed=8)[0]
    started = time.monotonic()
    transfer = sender.submit(
        envelope_for("q", src, has_slot=True), make_arena(ARENA_BYTES, 15), deadline_s=0.5
    )
    assert failure_of(transfer).kind is FailureKind.TIMEOUT
    assert time.monotonic() - started < 30


def test_caller_mistakes_are_refused_before_queueing(pair):
    sender, receiver = pair
    src = tables(seed=9)[0]
    arena = make_arena(ARENA_BYTES, 16)
    with pytest.raises(EnvelopeInvalid) as bad_ranges:
        envelope_for("m", src.to(torch.int32), has_slot=True)
    assert (bad_ranges.value.field, bad_ranges.value.value) == ("ranges", f"{tuple(src.shape)} torch.int32")
    with pytest.raises(RequestIdInvalid) as long_id:
        envelope_for("m" * 257, src, has_slot=True)
    assert (long_id.value.field, long_id.value.value, long_id.value.limit) == ("request_id", "m" * 257, 256)
    with pytest.raises(HeldPagesInvalid) as held:
        Envelope(request_id="m", num_tokens=1, ranges=src, has_slot=True, held_pages=41)
    assert (held.value.held_pages, held.value.pages) == (41, 40)
    for refusal in (bad_ranges.value, long_id.value, held.value):  # each crosses processes whole
        assert vars(pickle.loads(pickle.dumps(refusal))) == vars(refusal)
    with pytest.raises(RangesRefused) as past:
        sender.submit(envelope_for("m", src, has_slot=True), arena[: 1 << 20])
    assert (past.value.problem, past.value.arena_bytes) == (PAST_ARENA, 1 << 20)
    with pytest.raises(ArgInvalid) as buffer:
        receiver.expect(envelope_for("m", src, has_slot=True), arena.view(torch.int32))
    assert buffer.value.field == "the arena buffer"
    receiver.expect(envelope_for("dup", src, has_slot=True), arena, deadline_s=5)
    with pytest.raises(AlreadyExpected) as again:
        receiver.expect(envelope_for("dup", src, has_slot=True), arena, deadline_s=5)
    assert again.value.request_id == "dup"


def test_a_later_larger_staged_chunk_does_not_replace_a_buffer_still_to_be_sent(pair):
    """Regression: chunk 0 (a 32 KiB slot sent direct + nothing staged) then chunk 1 staging 64 KiB
    of scattered pages used to reallocate every staging buffer, so a chunk went out unfilled."""
    sender, receiver = pair
    rows = [[0, 32 << 10]] + [[(64 << 10) + i * 8192, 4096] for i in range(24)]
    ranges = torch.tensor(rows, dtype=torch.int64)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    envelope = envelope_for("grow", ranges, has_slot=True)
    incoming = receiver.expect(envelope, dst, deadline_s=5)
    sender.submit(envelope, src, deadline_s=5).wait()
    incoming.wait()
    assert all(torch.equal(src[o : o + n], dst[o : o + n]) for o, n in rows)


def test_a_queued_transfer_fails_at_its_own_deadline_or_abort_not_when_dequeued(pair):
    """Regression: a sender transfer queued behind a slow one concluded only when the worker
    reached it, however long past its deadline or its abort."""
    sender, _ = pair
    ranges = torch.tensor([[0, 4096]], dtype=torch.int64)
    src = torch.zeros(1 << 16, dtype=torch.uint8)
    # Nobody expects "slow": the receiver holds it for unexpected_wait_s (0.3 s) before refusing.
    slow = sender.submit(envelope_for("slow", ranges, has_slot=False), src, deadline_s=10)
    late = sender.submit(envelope_for("late", ranges, has_slot=False), src, deadline_s=0.05)
    gave_up = sender.submit(envelope_for("gave-up", ranges, has_slot=False), src, deadline_s=10)
    gave_up.abort("caller gave up")
    for transfer, kind in ((gave_up, FailureKind.ABORTED), (late, FailureKind.TIMEOUT)):
        assert failure_of(transfer).kind is kind
    assert not slow.done(), "both concluded while the transfer ahead of them was still running"
    with pytest.raises(TransferError):
        slow.wait()


def test_nothing_lands_in_the_arena_after_a_failed_receive_concludes(pair):
    """A receiver failing mid-stream, with receives still posted into its arena, takes the group
    down before it concludes: bytes the sender sends later cannot land in pages freed by then."""
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 17), make_arena(ARENA_BYTES, 18)
    kw = dict(num_pages=64, page_bytes=PAGE_BYTES, arena_pages=ARENA_BYTES // PAGE_BYTES, fragmentation=0.0)
    src, dst = fragmented_ranges(seed=31, **kw), fragmented_ranges(seed=32, **kw)

    def fail_on_first_chunk(transfer, index):
        raise RuntimeError("the receiving worker failed")

    incoming = receiver.expect(
        envelope_for("late", dst, has_slot=False), dst_arena, deadline_s=60, on_chunk=fail_on_first_chunk
    )
    outgoing = sender.submit(
        envelope_for("late", src, has_slot=False),
        src_arena,
        deadline_s=60,
        on_chunk=lambda transfer, index: time.sleep(0.2),  # later chunks leave after the failure
    )
    assert failure_of(incoming).kind is FailureKind.INTERNAL
    at_conclusion, failed_at = dst_arena.clone(), time.monotonic()
    # The sender hears it from the receiver's status or from the closed link (whose wait Gloo ends
    # as if it timed out), whichever comes first.
    failure = failure_of(outgoing)
    assert failure.kind in (FailureKind.INTERNAL, FailureKind.PEER_LOST, FailureKind.TIMEOUT)
    assert failure.channel_broken
    assert time.monotonic() - failed_at < 30  # told, not left to its minute's deadline
    assert torch.equal(dst_arena, at_conclusion)
    assert not receiver.channel.healthy and not sender.channel.healthy
    # Both ends rebuild, and the channel carries the envelope whole.
    rebuild = threading.Thread(target=receiver.connect)
    rebuild.start()
    sender.connect()
    rebuild.join()
    round_trip(sender, receiver, "again", (src_arena, src), (dst_arena, dst), has_slot=False)


def test_a_receiver_failing_after_the_last_chunk_tells_the_sender_at_once(pair):
    sender, receiver = pair
    src_arena, dst_arena = make_arena(ARENA_BYTES, 19), make_arena(ARENA_BYTES, 20)
    src, dst = tables(seed=41)

    def fail_on_last_chunk(transfer, index):
        if index == transfer_chunks - 1:
            raise RuntimeError("the receiving worker failed late")

    transfer_chunks = -(-int(dst[:, 1].sum()) // sender.options.chunk_bytes)
    incoming = receiver.expect(
        envelope_for("last", dst, has_slot=True), dst_arena, deadline_s=60, on_chunk=fail_on_last_chunk
    )
    started = time.monotonic()
    outgoing = sender.submit(envelope_for("last", src, has_slot=True), src_arena, deadline_s=60)
    for transfer in (incoming, outgoing):
        failure = failure_of(transfer)  # the sender, too, hears what kind of failure it was
        assert failure.kind is FailureKind.INTERNAL and failure.channel_broken
    assert time.monotonic() - started < 30  # the receiver's STATUS said so; no minute's wait
    assert not sender.channel.healthy and not receiver.channel.healthy


def test_done_callbacks_have_run_by_the_time_a_waiter_wakes():
    """Regression: wait() returned while the callback that frees a failed reservation was still to
    run, so a caller that cancelled and then reserved again found the old reservation."""
    seen = []
    transfer = Transfer(request_id="cb", role="receiver", num_bytes=1, deadline_s=5)

    def slow_callback(t):
        time.sleep(0.2)
        seen.append(t.state)

    transfer.add_done_callback(slow_callback)
    threading.Thread(
        target=transfer.conclude, args=(TransferError("cb", FailureKind.INTERNAL, "failed on purpose"),)
    ).start()
    with pytest.raises(TransferError):
        transfer.wait()
    assert seen == [TransferState.FAILED]
    late = []
    transfer.add_done_callback(late.append)  # after the conclusion: runs at once
    assert late == [transfer]


def test_a_ready_that_crossed_the_withdrawal_is_answered_as_an_abort(pair, monkeypatch):
    """The sender's deadline passes while the receiver waits for the reservation; the receiver then
    answers READY without seeing the withdrawal (as when the two messages cross). The sender, failed
    already, sends the stream as after an abort and ends it with ABORT: both ends fail, the channel
    stays in step."""
    sender, receiver = pair
    receiver.unexpected_wait_s = 3.0
    monkeypatch.setattr(receiver.channel.control, "holds", lambda name: False)
    src_arena, dst_arena = make_arena(ARENA_BYTES, 21), make_arena(ARENA_BYTES, 22)
    src, dst = tables(seed=51)
    outside = digest_outside(dst_arena, dst)
    outgoing = sender.submit(envelope_for("crossed", src, has_slot=True), src_arena, deadline_s=0.3)
    assert failure_of(outgoing).kind is FailureKind.TIMEOUT
    incoming = receiver.expect(envelope_for("crossed", dst, has_slot=True), dst_arena, deadline_s=5)
    assert failure_of(incoming).kind is FailureKind.TIMEOUT  # the sender's ABORT said why
    assert digest_outside(dst_arena, dst) == outside
    assert sender.channel.healthy and receiver.channel.healthy
    again = (make_arena(ARENA_BYTES, 23), src), (make_arena(ARENA_BYTES, 24), dst)
    round_trip(sender, receiver, "after-crossed", *again, has_slot=True)
