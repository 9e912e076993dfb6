"""Faults between two real processes: the survivor fails within its deadline, keeps its accounting,
and its channel is rebuilt (or still works) afterwards.

Each scenario: this process holds one end and a `Ledger` for its memory (reserve, pin for the
transfer, unpin and release on every outcome); a spawned peer holds the other end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from tests.transfer.transfer_peer import (
    LAYOUT,
    Ledger,
    Peer,
    devices,
    digest,
    envelope_for,
    fragmented_ranges,
    free_port,
    make_arena,
    make_engine,
    open_pair,
    wait_for_offer,
)
from transfer import (
    EnvelopeReceiver,
    EnvelopeSender,
    FailureKind,
    FingerprintMismatch,
    TransferError,
    TransferState,
)
from transfer.wire import offer_key

ARENA_BYTES = 8 << 20
PAGE_BYTES, SLOT_BYTES = 4096, 12288
ARENA_PAGES = (ARENA_BYTES - SLOT_BYTES) // PAGE_BYTES
SMALL_CHUNKS = {"chunk_bytes": 64 << 10, "direct_min_bytes": 1 << 30}  # ~30 chunks per envelope below

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu2, two_gpus])]


def tables(seed: int, num_pages: int = 480) -> tuple[torch.Tensor, torch.Tensor]:
    kw = dict(
        num_pages=num_pages,
        page_bytes=PAGE_BYTES,
        arena_pages=ARENA_PAGES,
        fragmentation=1.0,
        slot_bytes=SLOT_BYTES,
    )
    return fragmented_ranges(seed=seed, **kw), fragmented_ranges(seed=seed + 500, **kw)


def run_and_release(ledger: Ledger, rid: str, transfer) -> tuple[TransferError | None, float]:
    """Wait for `transfer`, then unpin and release like a pool owner would; (error, seconds waited)."""
    started = time.monotonic()
    try:
        transfer.wait()
        error = None
    except TransferError as exc:
        error = exc
    finally:
        ledger.unpin(rid)
        ledger.release(rid)
    return error, time.monotonic() - started


def reserve(ledger: Ledger, rid: str, table: torch.Tensor) -> None:
    ledger.reserve(rid, table)
    ledger.pin(rid)


def assert_works_again(
    local, peer: Peer, name: str, local_device: str, *, local_is_sender: bool, rid: str
) -> None:
    src, dst = tables(seed=77, num_pages=64)
    arena = make_arena(ARENA_BYTES, seed=9, device=local_device)
    peer.call("arena", name=name, num_bytes=ARENA_BYTES, seed=10)
    if local_is_sender:
        peer.call("begin", name=name, rid=rid, ranges=dst.tolist(), has_slot=True)
        local.submit(envelope_for(rid, src, has_slot=True), arena, deadline_s=10).wait()
        result = peer.call("wait", name=name, rid=rid)
        assert result["state"] == "success" and result["digest"] == digest(arena, src)
    else:
        incoming = local.expect(envelope_for(rid, dst, has_slot=True), arena, deadline_s=10)
        peer.call("begin", name=name, rid=rid, ranges=src.tolist(), has_slot=True)
        incoming.wait()
        assert peer.call("wait", name=name, rid=rid)["digest"] == digest(arena, dst)


@pytest.mark.parametrize("device", DEVICES)
def test_kill_the_sender_mid_transfer(device):
    local_device, peer_device = devices(device)
    port, name = free_port(), "ks"
    doomed, replacement = Peer(), Peer()  # spawn both now: the replacement starts while we test
    try:
        doomed.call("ready")  # two processes importing torch at once can take most of a connect timeout
        doomed.start("open", name=name, rank=0, port=port, device=peer_device, options=SMALL_CHUNKS)
        receiver = make_engine(1, port, local_device, name=name, options=SMALL_CHUNKS)
        receiver.connect()
        assert doomed.result()["ok"]
        doomed.call("arena", name=name, num_bytes=ARENA_BYTES, seed=1)
        src, dst = tables(seed=1)
        ledger, arena = Ledger(ARENA_BYTES), make_arena(ARENA_BYTES, seed=2, device=local_device)
        reserve(ledger, "k", dst)
        # A minute's deadline: the broken link fails it, long before (a generous bound, not a timing).
        incoming = receiver.expect(envelope_for("k", dst, has_slot=True), arena, deadline_s=60)
        doomed.start("begin", name=name, rid="k", ranges=src.tolist(), has_slot=True, kill_after_chunk=3)
        error, waited = run_and_release(ledger, "k", incoming)
        assert error is not None and error.channel_broken, error
        assert incoming.state is TransferState.FAILED and incoming.num_chunks_done <= 5
        assert waited < 30
        ledger.check_invariants()
        assert ledger.free_bytes == ARENA_BYTES and not ledger.pinned
        assert not receiver.channel.healthy
        doomed.kill()

        replacement.call("ready")
        replacement.start("open", name=name, rank=0, port=port, device=peer_device, options=SMALL_CHUNKS)
        receiver.connect()
        assert replacement.result()["ok"]
        assert_works_again(receiver, replacement, name, local_device, local_is_sender=False, rid="after")

        # An idle receiver (blocked on the store for the next bell) notices its sender dying.
        replacement.kill()
        started = time.monotonic()
        while receiver.channel.healthy and time.monotonic() - started < 30:
            time.sleep(0.02)
        assert not receiver.channel.healthy
        receiver.close()
    finally:
        doomed.kill()
        replacement.close()


@pytest.mark.parametrize("device", DEVICES)
def test_kill_the_receiver_mid_transfer(device):
    local_device, peer_device = devices(device)
    port, name = free_port(), "kr"
    doomed, replacement = Peer(), Peer()
    try:
        doomed.call("ready")
        doomed.start("open", name=name, rank=1, port=port, device=peer_device)
        sender = make_engine(0, port, local_device, name=name, options=SMALL_CHUNKS)
        sender.connect()
        assert doomed.result()["ok"]
        doomed.call("arena", name=name, num_bytes=ARENA_BYTES, seed=3)
        src, dst = tables(seed=2)
        ledger, arena = Ledger(ARENA_BYTES), make_arena(ARENA_BYTES, seed=4, device=local_device)
        reserve(ledger, "k", src)
        doomed.call("begin", name=name, rid="k", ranges=dst.tolist(), has_slot=True, kill_after_chunk=3)
        outgoing = sender.submit(envelope_for("k", src, has_slot=True), arena, deadline_s=60)
        error, waited = run_and_release(ledger, "k", outgoing)
        assert error is not None and error.channel_broken, error  # the broken link, not the deadline
        assert waited < 30
        ledger.check_invariants()
        assert ledger.free_bytes == ARENA_BYTES
        doomed.kill()

        replacement.call("ready")
        replacement.start("open", name=name, rank=1, port=port, device=peer_device)
        sender.connect()
        assert replacement.result()["ok"]
        assert sender.channel.generation == 2
        assert_works_again(sender, replacement, name, local_device, local_is_sender=True, rid="after")
        sender.close()
    finally:
        doomed.kill()
        replacement.close()


@pytest.fixture(scope="module")
def peer():
    process = Peer()
    yield process
    process.close()


@dataclass
class Scenario:
    """One fault scenario's local end (opened with the peer), its device and its memory ledger."""

    name: str
    local_device: str
    end: EnvelopeSender | EnvelopeReceiver
    ledger: Ledger


@pytest.fixture
def scenario(peer, device):
    """Opens a channel with the peer as `scenario(stem, local_rank=...)`; closes both ends after."""
    opened: list[Scenario] = []

    def open_scenario(stem: str, *, local_rank: int) -> Scenario:
        name = f"{stem}-{device}"
        end = open_pair(peer, local_rank=local_rank, device=device, name=name, options=SMALL_CHUNKS)
        opened.append(Scenario(name, devices(device)[0], end, Ledger(ARENA_BYTES)))
        return opened[-1]

    yield open_scenario
    for s in opened:
        s.end.close()
        peer.call("close", name=s.name)


@pytest.mark.parametrize("device", DEVICES)
def test_a_peer_that_never_sends_fails_the_expectation_at_its_deadline(peer, device, scenario):
    s = scenario("never", local_rank=1)
    name, local_device, receiver, ledger = s.name, s.local_device, s.end, s.ledger
    dst = tables(seed=3)[1]
    reserve(ledger, "n", dst)
    incoming = receiver.expect(
        envelope_for("n", dst, has_slot=True), make_arena(ARENA_BYTES, 5, local_device), deadline_s=1.0
    )
    error, waited = run_and_release(ledger, "n", incoming)
    assert error.kind is FailureKind.TIMEOUT
    assert waited < 30
    ledger.check_invariants()
    assert receiver.channel.healthy  # nothing was in flight: the channel is fine as it is
    assert_works_again(receiver, peer, name, local_device, local_is_sender=False, rid="after-never")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offered", [False, True], ids=["waits_for_ready", "planned_on_offer"])
def test_a_silent_receiver_fails_the_sender_within_its_deadline(peer, device, scenario, offered):
    """The receiver freezes after its reservation. A header waiting for READY is withdrawn at the
    sender's deadline, and both ends stay in step; one planned on the offer is sending already, so
    the sender fails at its deadline as well, and the channel with it, which both ends rebuild."""
    s = scenario(f"silent-{offered}", local_rank=0)
    name, local_device, sender, ledger = s.name, s.local_device, s.end, s.ledger
    src, dst = tables(seed=4)
    reserve(ledger, "s", src)
    peer.call("arena", name=name, num_bytes=ARENA_BYTES, seed=6)
    peer.call("begin", name=name, rid="s", ranges=dst.tolist(), has_slot=True, deadline_s=30)
    wait_for_offer(sender, "s")
    if not offered:  # the sender drops the offer: its header waits for READY
        sender.channel.control.take_offer(offer_key("s"))
    peer.start("stop_for", seconds=6)  # the whole peer freezes, then resumes
    time.sleep(0.3)
    outgoing = sender.submit(
        envelope_for("s", src, has_slot=True), make_arena(ARENA_BYTES, 7, local_device), deadline_s=1.0
    )
    error, waited = run_and_release(ledger, "s", outgoing)
    assert error.kind is FailureKind.TIMEOUT and error.channel_broken is offered
    assert not peer.answered()  # failed at its own deadline, while the peer was still frozen
    ledger.check_invariants()
    peer.result()
    if offered:
        assert peer.call("wait", name=name, rid="s")["state"] == "failed"
        peer.start("rebuild", name=name)
        sender.connect()
        assert peer.result()["ok"]
    else:  # the peer, resumed, finds the header withdrawn: its side fails too, both in step
        assert peer.call("wait", name=name, rid="s")["error"]["kind"] == FailureKind.TIMEOUT
    assert_works_again(sender, peer, name, local_device, local_is_sender=True, rid="after-silent")


@pytest.mark.parametrize("device", DEVICES)
def test_a_slow_receiver_past_the_deadline_breaks_the_channel_which_is_rebuilt(peer, device, scenario):
    s = scenario("slow", local_rank=0)
    name, local_device, sender, ledger = s.name, s.local_device, s.end, s.ledger
    src, dst = tables(seed=5)
    reserve(ledger, "slow", src)
    peer.call("arena", name=name, num_bytes=ARENA_BYTES, seed=8)
    peer.call("begin", name=name, rid="slow", ranges=dst.tolist(), has_slot=True, delay_s=0.3, deadline_s=30)
    outgoing = sender.submit(
        envelope_for("slow", src, has_slot=True),
        make_arena(ARENA_BYTES, 9, local_device),
        deadline_s=1.5,
    )
    error, waited = run_and_release(ledger, "slow", outgoing)
    assert error.channel_broken and error.kind is FailureKind.TIMEOUT
    assert waited < 30
    ledger.check_invariants()
    assert peer.call("wait", name=name, rid="slow")["state"] == "failed"
    peer.start("rebuild", name=name)
    sender.connect()
    assert peer.result()["ok"]
    assert_works_again(sender, peer, name, local_device, local_is_sender=True, rid="after-slow")


@pytest.mark.parametrize("device", DEVICES)
def test_a_sender_frozen_mid_stream_fails_the_receiver_at_its_deadline(peer, device, scenario):
    """The frozen sender also hosts the store: the failing receiver must not wait on it."""
    s = scenario("frozen", local_rank=1)
    name, local_device, receiver, ledger = s.name, s.local_device, s.end, s.ledger
    src, dst = tables(seed=6)
    reserve(ledger, "frozen", dst)
    peer.call("arena", name=name, num_bytes=ARENA_BYTES, seed=11)
    incoming = receiver.expect(
        envelope_for("frozen", dst, has_slot=True),
        make_arena(ARENA_BYTES, 12, local_device),
        deadline_s=1.5,
    )
    peer.call(
        "begin", name=name, rid="frozen", ranges=src.tolist(), has_slot=True, delay_s=0.2, deadline_s=30
    )
    time.sleep(0.3)
    peer.start("stop_for", seconds=5)
    error, waited = run_and_release(ledger, "frozen", incoming)
    assert error.channel_broken and error.kind is FailureKind.TIMEOUT
    assert not peer.answered()  # failed while the sender (and its store) was still frozen
    ledger.check_invariants()
    assert ledger.free_bytes == ARENA_BYTES and not ledger.pinned
    peer.result()
    assert peer.call("wait", name=name, rid="frozen")["state"] == "failed"  # resumed into a closed link
    peer.start("rebuild", name=name)
    receiver.connect()
    assert peer.result()["ok"]
    assert_works_again(receiver, peer, name, local_device, local_is_sender=False, rid="after-frozen")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["garbage", "wrong_tokens", "wrong_row_bytes"])
def test_a_corrupt_header_is_refused_and_nothing_is_written(peer, kind, device, scenario):
    s = scenario(f"corrupt-{kind}", local_rank=1)
    name, local_device, receiver, ledger = s.name, s.local_device, s.end, s.ledger
    src, dst = tables(seed=6)
    arena = make_arena(ARENA_BYTES, 11, local_device)
    before = digest(arena, dst)
    reserve(ledger, "c", dst)
    incoming = receiver.expect(envelope_for("c", dst, has_slot=True), arena, deadline_s=1.0)
    reply = peer.call("corrupt_header", name=name, rid="c", kind=kind, ranges=src.tolist())
    assert "refuse" in reply
    error, waited = run_and_release(ledger, "c", incoming)
    expected = {
        "garbage": FailureKind.TIMEOUT,  # not a header at all: the expectation waits for a real one
        "wrong_tokens": FailureKind.REFUSED,
        "wrong_row_bytes": FailureKind.REFUSED,
    }[kind]
    assert error.kind is expected
    assert waited < 30
    assert digest(arena, dst) == before
    ledger.check_invariants()
    assert receiver.channel.healthy and not error.channel_broken
    assert_works_again(receiver, peer, name, local_device, local_is_sender=False, rid=f"after-{kind}")


@pytest.mark.parametrize("device", DEVICES)
def test_a_fingerprint_mismatch_between_processes_is_refused_then_fixed(peer, device):
    local_device, peer_device = devices(device)
    port, name = free_port(), f"mismatch-{device}"
    peer.start(
        "open", name=name, rank=1, port=port, device=peer_device, layout={**LAYOUT, "page_bytes": 8192}
    )
    sender = make_engine(0, port, local_device, name=name, options=SMALL_CHUNKS)
    with pytest.raises(FingerprintMismatch) as raised:
        sender.connect()
    assert list(raised.value.fields) == ["layout.page_bytes"]
    assert raised.value.fields["layout.page_bytes"] == (4096, 8192)
    refused = peer.result()
    refused.pop("message")
    assert refused == {"ok": False, "error": "FingerprintMismatch", "fields": ["layout.page_bytes"]}
    peer.call("close", name=name)
    peer.start("open", name=name, rank=1, port=port, device=peer_device)
    sender.connect()
    assert peer.result()["ok"]
    assert_works_again(sender, peer, name, local_device, local_is_sender=True, rid="after-mismatch")
