"""Two real processes: round trips of fragmented envelopes, queues, and several channels per process.

The test process holds one end of each channel; a spawned peer (tests/transfer/transfer_peer.py)
holds the other. Parameterised for CPU/Gloo and CUDA/NCCL (two GPUs, marker gpu2).
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.transfer.transfer_peer import (
    Peer,
    devices,
    digest,
    digest_outside,
    envelope_for,
    fragmented_ranges,
    make_arena,
    open_pair,
)
from transfer import TransferState

ARENA_BYTES = 8 << 20
PAGE_BYTES, SLOT_BYTES = 4096, 12288
ARENA_PAGES = (ARENA_BYTES - SLOT_BYTES) // PAGE_BYTES

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu2, two_gpus])]


@pytest.fixture(scope="module")
def peer():
    process = Peer()
    yield process
    process.close()


def ranges(seed: int, num_pages: int, fragmentation: float, slot: bool = True) -> torch.Tensor:
    return fragmented_ranges(
        num_pages=num_pages,
        page_bytes=PAGE_BYTES,
        arena_pages=ARENA_PAGES,
        fragmentation=fragmentation,
        seed=seed,
        slot_bytes=SLOT_BYTES if slot else 0,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_random_fragmented_envelopes_arrive_byte_identical(peer, device):
    sender = open_pair(
        peer,
        local_rank=0,
        device=device,
        name=f"rt-{device}",
        options={"chunk_bytes": 256 << 10, "direct_min_bytes": 32 << 10, "checksum": True},
    )
    src_arena = make_arena(ARENA_BYTES, seed=100, device=devices(device)[0])
    peer.call("arena", name=f"rt-{device}", num_bytes=ARENA_BYTES, seed=200)
    cases = [
        (0.0, 1, True),
        (0.0, 300, False),
        (0.3, 97, True),
        (1.0, 1, True),
        (1.0, 500, True),
        (0.7, 1024, False),
        (0.05, 64, True),
    ]
    for i, (fragmentation, num_pages, slot) in enumerate(cases):
        src, dst = ranges(i, num_pages, fragmentation, slot), ranges(1000 + i, num_pages, fragmentation, slot)
        before = peer.call("wait_digest", name=f"rt-{device}", ranges=dst.tolist()) if i == 0 else None
        peer.call("begin", name=f"rt-{device}", rid=f"rt{i}", ranges=dst.tolist(), has_slot=slot)
        sender.submit(envelope_for(f"rt{i}", src, has_slot=slot), src_arena, deadline_s=10).wait()
        result = peer.call("wait", name=f"rt-{device}", rid=f"rt{i}")
        assert result["state"] == "success", result["error"]
        assert result["digest"] == digest(src_arena, src), f"case {i}: {fragmentation=} {num_pages=}"
        if before is not None:
            assert result["outside"] == before["outside"]  # nothing outside the envelope was written
    sender.close()
    peer.call("close", name=f"rt-{device}")


@pytest.mark.parametrize("device", DEVICES)
def test_back_to_back_and_concurrently_queued_on_one_channel(peer, device):
    name = f"q-{device}"
    sender = open_pair(peer, local_rank=0, device=device, name=name, options={"chunk_bytes": 128 << 10})
    src_arena = make_arena(ARENA_BYTES, seed=101, device=devices(device)[0])
    peer.call("arena", name=name, num_bytes=ARENA_BYTES, seed=201)
    # 16 envelopes of 24 pages, disjoint on each side: expected in one order, submitted in another.
    g = torch.Generator().manual_seed(5)
    src_pages, dst_pages = torch.randperm(ARENA_PAGES, generator=g), torch.randperm(ARENA_PAGES, generator=g)
    tables = [
        (
            torch.stack([src_pages[i * 24 : i * 24 + 24] * PAGE_BYTES, torch.full((24,), PAGE_BYTES)], 1),
            torch.stack([dst_pages[i * 24 : i * 24 + 24] * PAGE_BYTES, torch.full((24,), PAGE_BYTES)], 1),
        )
        for i in range(16)
    ]
    for i in reversed(range(16)):
        peer.call("begin", name=name, rid=f"q{i}", ranges=tables[i][1].tolist(), has_slot=False)
    transfers = [
        sender.submit(envelope_for(f"q{i}", tables[i][0], has_slot=False), src_arena, deadline_s=20)
        for i in range(16)
    ]
    for i, transfer in enumerate(transfers):
        transfer.wait()
        result = peer.call("wait", name=name, rid=f"q{i}")
        assert result["state"] == "success" and result["digest"] == digest(src_arena, tables[i][0])
    # Back to back: the same envelope again and again on the same channel.
    for i in range(5):
        peer.call("begin", name=name, rid=f"again{i}", ranges=tables[0][1].tolist(), has_slot=False)
        assert (
            sender.submit(
                envelope_for(f"again{i}", tables[0][0], has_slot=False),
                src_arena,
                deadline_s=10,
            )
            .wait()
            .state
            is TransferState.SUCCESS
        )
        assert peer.call("wait", name=name, rid=f"again{i}")["state"] == "success"
    sender.close()
    peer.call("close", name=name)


@pytest.mark.parametrize("device", DEVICES)
def test_several_channels_in_one_process_both_directions_and_an_independent_rebuild(peer, device):
    # This process sends on channel "out" and receives on channel "in", at the same time.
    sender = open_pair(
        peer, local_rank=0, device=device, name=f"out-{device}", options={"chunk_bytes": 64 << 10}
    )
    receiver = open_pair(peer, local_rank=1, device=device, name=f"in-{device}")
    local = devices(device)[0]
    src_arena, dst_arena = make_arena(ARENA_BYTES, 102, local), make_arena(ARENA_BYTES, 103, local)
    peer.call("arena", name=f"out-{device}", num_bytes=ARENA_BYTES, seed=202)
    peer.call("arena", name=f"in-{device}", num_bytes=ARENA_BYTES, seed=203)
    out_src, out_dst = ranges(7, 400, 1.0), ranges(8, 400, 1.0)
    in_src, in_dst = ranges(9, 300, 0.5), ranges(10, 300, 0.5)
    peer.call("begin", name=f"out-{device}", rid="o1", ranges=out_dst.tolist(), has_slot=True)
    incoming = receiver.expect(envelope_for("i1", in_dst, has_slot=True), dst_arena, deadline_s=10)
    peer.call("begin", name=f"in-{device}", rid="i1", ranges=in_src.tolist(), has_slot=True)
    outgoing = sender.submit(envelope_for("o1", out_src, has_slot=True), src_arena, deadline_s=10)
    outgoing.wait()
    incoming.wait()
    assert peer.call("wait", name=f"out-{device}", rid="o1")["digest"] == digest(src_arena, out_src)
    assert peer.call("wait", name=f"in-{device}", rid="i1")["digest"] == digest(dst_arena, in_dst)

    # Rebuild "out" on both ends while "in" carries a transfer: "in" does not notice.
    incoming = receiver.expect(envelope_for("i2", in_dst, has_slot=True), dst_arena, deadline_s=10)
    peer.call("begin", name=f"in-{device}", rid="i2", ranges=in_src.tolist(), has_slot=True)
    peer.start("rebuild", name=f"out-{device}")
    rebuild = threading.Thread(target=sender.connect)
    rebuild.start()
    incoming.wait()
    rebuild.join(timeout=30)
    assert peer.result()["ok"]
    assert sender.channel.generation == 2 and receiver.channel.generation == 1
    assert peer.call("wait", name=f"in-{device}", rid="i2")["state"] == "success"
    peer.call("begin", name=f"out-{device}", rid="o2", ranges=out_dst.tolist(), has_slot=True)
    sender.submit(envelope_for("o2", out_src, has_slot=True), src_arena, deadline_s=10).wait()
    assert peer.call("wait", name=f"out-{device}", rid="o2")["digest"] == digest(src_arena, out_src)
    sender.close()
    receiver.close()
    peer.call("close", name=f"out-{device}")
    peer.call("close", name=f"in-{device}")


def test_the_destination_outside_the_envelope_is_never_written(peer):
    name = "outside"
    sender = open_pair(peer, local_rank=0, device="cpu", name=name, options={"chunk_bytes": 96 << 10})
    src_arena = make_arena(ARENA_BYTES, seed=104)
    peer.call("arena", name=name, num_bytes=ARENA_BYTES, seed=204)
    src, dst = ranges(11, 700, 0.8), ranges(12, 700, 0.8)
    before = peer.call("wait_digest", name=name, ranges=dst.tolist())
    peer.call("begin", name=name, rid="w", ranges=dst.tolist(), has_slot=True)
    sender.submit(envelope_for("w", src, has_slot=True), src_arena, deadline_s=10).wait()
    after = peer.call("wait", name=name, rid="w")
    assert after["digest"] == digest(src_arena, src) != before["digest"]
    assert (
        after["outside"]
        == before["outside"]
        == peer.call("wait_digest", name=name, ranges=dst.tolist())["outside"]
    )
    assert digest_outside(src_arena, src) == digest_outside(make_arena(ARENA_BYTES, seed=104), src)
    sender.close()
    peer.call("close", name=name)
