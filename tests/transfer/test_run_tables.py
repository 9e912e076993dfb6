"""Random run tables, byte-exact through the engine: pages scattered on either side or both, runs of
mixed sizes that straddle chunk boundaries, zero-copy and staged messages in one envelope.

One channel pair serves every example (hypothesis draws the tables, the chunk size and the zero-copy
threshold); each example checks the destination's bytes against the source's and that nothing
outside the destination's rows was written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distpool.memory.envelope import Envelope
from tests.transfer.conftest import connected_pair
from tests.transfer.transfer_peer import make_arena
from transfer import TransferOptions, TransferState
from transfer.pair.control import FRAME_BYTES, frames
from transfer.wire.protocol import TAG_DATA

ARENA_BYTES = 1 << 20
# Row sizes: KV-head slices (small, some odd), pages, and long runs such as halves of a state.
ROW_SIZES = st.one_of(
    st.integers(1, 300),
    st.sampled_from([1024, 4096, 24576]),
    st.integers(16 << 10, 80 << 10),
)


@pytest.fixture(scope="module")
def engines():
    sender, receiver = connected_pair("runs", timeout_s=10)
    arenas = make_arena(ARENA_BYTES, seed=1), make_arena(ARENA_BYTES, seed=2)
    yield sender, receiver, arenas
    sender.close()
    receiver.close()


def place(sizes: list[int], layout: str, rng: np.random.Generator) -> torch.Tensor:
    """(n, 2) ranges of `sizes` in the arena: back to back, in a shuffled order with gaps, or back
    to back in reverse order (adjacent in the arena, never in stream order)."""
    sizes_np = np.asarray(sizes, dtype=np.int64)
    if layout == "contiguous":
        start = int(rng.integers(0, ARENA_BYTES - sizes_np.sum()))
        offsets = start + np.cumsum(sizes_np) - sizes_np
    elif layout == "reversed":
        ends = ARENA_BYTES - (np.cumsum(sizes_np) - sizes_np)
        offsets = ends - sizes_np
    else:  # scattered: rows in a random order, with random gaps between them
        order = rng.permutation(len(sizes))
        gaps = rng.integers(0, min(3000, (ARENA_BYTES - int(sizes_np.sum())) // len(sizes)), len(sizes))
        spans = sizes_np[order] + gaps
        assert spans.sum() <= ARENA_BYTES
        placed = np.cumsum(spans) - spans + gaps
        offsets = np.empty_like(placed)
        offsets[order] = placed
    return torch.from_numpy(np.stack([offsets, sizes_np], axis=1))


def move(engines, src: torch.Tensor, dst: torch.Tensor, options: TransferOptions, rid: str) -> None:
    sender, receiver, (src_arena, dst_arena) = engines
    sender.options = options
    before = dst_arena.clone()
    expected = receiver.expect(Envelope(rid, 16, dst, has_slot=False), dst_arena, deadline_s=20)
    sent = sender.submit(Envelope(rid, 16, src, has_slot=False), src_arena, deadline_s=20)
    assert sent.wait(30).state is TransferState.SUCCESS, sent.error
    assert expected.wait(30).state is TransferState.SUCCESS, expected.error
    touched = torch.zeros(ARENA_BYTES, dtype=torch.bool)
    for (s, n), (d, _) in zip(src.tolist(), dst.tolist(), strict=True):
        assert torch.equal(dst_arena[d : d + n], src_arena[s : s + n]), (s, d, n)
        touched[d : d + n] = True
    assert torch.equal(dst_arena[~touched], before[~touched])  # nothing outside the reservation
    src_arena.copy_(torch.roll(src_arena, 7))  # fresh bytes for the next example


COUNT = iter(range(1 << 30))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(ROW_SIZES, min_size=1, max_size=24),
    layouts=st.tuples(*[st.sampled_from(["contiguous", "scattered", "reversed"])] * 2),
    chunk_bytes=st.sampled_from([1000, 4096, 20000, 64 << 10, 1 << 20]),
    direct_min_bytes=st.sampled_from([512, 8 << 10, 32 << 10, 1 << 30]),
    seed=st.integers(0, 2**16),
)
def test_random_run_tables_land_byte_exact_either_way(
    engines, sizes, layouts, chunk_bytes, direct_min_bytes, seed
):
    rng = np.random.default_rng(seed)
    src, dst = (place(sizes, layout, rng) for layout in layouts)
    options = TransferOptions(chunk_bytes=chunk_bytes, direct_min_bytes=direct_min_bytes, checksum=True)
    move(engines, src, dst, options, f"random-{next(COUNT)}")


def test_an_envelope_whose_header_outgrows_one_control_frame_moves_intact(engines):
    """5,000 rows: the header and READY tables (16 bytes a row) go as a frame and its remainder."""
    rng = np.random.default_rng(3)
    sizes = [int(n) for n in rng.integers(1, 150, 5000)]
    src, dst = place(sizes, "scattered", rng), place(sizes, "reversed", rng)
    assert 16 * 5000 > FRAME_BYTES
    options = TransferOptions(chunk_bytes=64 << 10, direct_min_bytes=8 << 10)
    move(engines, src, dst, options, "long-header")


@pytest.mark.parametrize("nbytes", [10, FRAME_BYTES - 100, FRAME_BYTES, 3 * FRAME_BYTES])
def test_a_control_message_is_one_gloo_message_unless_it_outgrows_the_frame(nbytes):
    sealed = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    parts = frames("bell/7", sealed)
    assert len(parts) == (1 if sum(p.numel() for p in parts) <= FRAME_BYTES else 2)
    assert all(p.numel() <= FRAME_BYTES for p in parts[:1])
    body = b"".join(p.numpy().tobytes() for p in parts)
    assert int.from_bytes(body[:4], "little") == len(body) - 4
    assert body[4:6] == len(b"bell/7").to_bytes(2, "little") and body[6:12] == b"bell/7"
    assert body[12:] == sealed


def count_sends(engines, src, dst, options, rid: str) -> tuple[int, int]:
    """Move an envelope; return how many payload messages both ends posted (sends, receives)."""
    sender, receiver, _ = engines
    posted = {"send": 0, "recv": 0}

    def counting(channel, what):
        original = getattr(channel, what)

        def post(tensor, tag):
            posted[what] += tag >= TAG_DATA  # payload only: control messages have a tag of their own
            return original(tensor, tag)

        return original, post

    originals = []
    for channel, what in ((sender.channel, "send"), (receiver.channel, "recv")):
        original, post = counting(channel, what)
        originals.append((channel, what))
        setattr(channel, what, post)
    try:
        move(engines, src, dst, options, rid)
    finally:
        for channel, what in originals:
            delattr(channel, what)  # the class's method again
    return posted["send"], posted["recv"]


@pytest.mark.parametrize("layouts", [("scattered", "scattered"), ("scattered", "contiguous")])
def test_a_scattered_envelope_of_small_runs_goes_as_one_staged_message_per_chunk(engines, layouts):
    """600 rows of 1 KiB spread over both arenas (or over the source only) move as one gathered
    message per 64 KiB chunk, plus the stream's trailer: never a message per run."""
    rng = np.random.default_rng(11)
    sizes = [1024] * 600
    src, dst = (place(sizes, layout, rng) for layout in layouts)
    options = TransferOptions(chunk_bytes=64 << 10, direct_min_bytes=32 << 10, checksum=True)
    num_chunks = -(-sum(sizes) // options.chunk_bytes)
    assert count_sends(engines, src, dst, options, "scattered-small") == (num_chunks + 1, num_chunks + 1)


def test_long_runs_among_scattered_small_ones_go_zero_copy_and_the_rest_in_one_batch(engines):
    """Rows of 48 KiB (over the 32 KiB threshold) beside 1 KiB ones, both sides scattered: each long
    run is a message of its own, the small ones of each chunk one staged batch."""
    rng = np.random.default_rng(12)
    sizes = [48 << 10 if i % 20 == 0 else 1024 for i in range(200)]
    src, dst = (place(sizes, "scattered", rng) for _ in range(2))
    options = TransferOptions(chunk_bytes=1 << 20, direct_min_bytes=32 << 10)
    assert sum(sizes) <= options.chunk_bytes  # one chunk: 10 long runs, one batch, the trailer
    assert count_sends(engines, src, dst, options, "mixed-runs") == (10 + 1 + 1, 10 + 1 + 1)


@pytest.mark.parametrize("swapped", [False, True], ids=["stretches at the source", "at the destination"])
def test_slices_back_to_back_on_one_side_and_scattered_on_the_other_go_a_message_a_stretch(engines, swapped):
    """TP 2 -> 1's shape: two stretches of back-to-back 1000-byte rows at the source, each row apart
    at the destination (TP 1 -> 2's: the other way round). Each stretch goes as one message, in
    place on its side, through the other side's staging buffer (back to back there, one gather or a
    scatter per message): bytes copied once, where one batch would copy them on both sides."""
    src = np.concatenate([1000 + np.arange(20) * 1000, 500_000 + np.arange(20) * 1000])
    dst = 100_000 + np.arange(40) * 3000
    sizes = np.full(40, 1000)
    src_table, dst_table = (torch.from_numpy(np.stack([o, sizes], axis=1)) for o in (src, dst))
    if swapped:
        src_table, dst_table = dst_table, src_table
    options = TransferOptions(chunk_bytes=1 << 20, direct_min_bytes=8 << 10, checksum=True)
    assert count_sends(engines, src_table, dst_table, options, "stretches") == (2 + 1, 2 + 1)
