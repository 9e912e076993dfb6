"""Gather / scatter between an arena and a contiguous buffer, and the checksum, on every copy path."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.ends import staging
from transfer.ends.segments import strided_segments
from transfer.ends.staging import PIPELINE_DEPTH, StagingBuffers, checksum, gather, scatter


def pieces(rows: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(rows, dtype=torch.int64)
    return t[:, 0].contiguous(), t[:, 1].contiguous()


def random_arena(num_bytes: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=g).to(device)


# The CUDA copies (index_select / index_copy_ on the GPU) run wherever a GPU is present.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


CASES = {
    # few pieces: one slice copy each
    "loop": [(4096, 300), (17, 5), (9000, 1000)],
    # many equal, aligned pieces: one indexed copy, one row per piece
    "rows": [
        (int(i) * 256, 256) for i in torch.randperm(200, generator=torch.Generator().manual_seed(1))[:64]
    ],
    # many pieces of several sizes, all multiples of 128: rows of 128 bytes
    "multi-row": [(i * 1024, 128 * (1 + i % 5)) for i in range(40)],
    # many pieces with odd offsets: rows of 1 byte, a small index still
    "odd": [(i * 97 + 3, 13) for i in range(60)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gather_packs_pieces_in_order(case, device):
    arena = random_arena(64 * 1024, seed=2, device=device)
    offsets, nbytes = pieces(CASES[case])
    out = torch.empty(int(nbytes.sum()), dtype=torch.uint8, device=device)
    gather(arena, offsets, nbytes, out)
    expected = torch.cat([arena[o : o + n] for o, n in CASES[case]])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_scatter_writes_only_the_pieces(case, device):
    arena = random_arena(64 * 1024, seed=3, device=device)
    before = arena.clone()
    offsets, nbytes = pieces(CASES[case])
    src = random_arena(int(nbytes.sum()), seed=4, device=device)
    scatter(src, offsets, nbytes, arena)
    position = 0
    touched = torch.zeros(arena.shape[0], dtype=torch.bool, device=device)
    for o, n in CASES[case]:
        assert torch.equal(arena[o : o + n], src[position : position + n])
        touched[o : o + n] = True
        position += n
    assert torch.equal(arena[~touched], before[~touched])


@pytest.mark.parametrize("device", DEVICES)
def test_checksum_is_crc32_of_the_stream_and_chains(device):
    arena = random_arena(10_000, seed=5, device=device)
    rows = [(5000, 100), (10, 50), (7000, 3)]
    offsets, nbytes = pieces(rows)
    stream = b"".join(arena[o : o + n].cpu().numpy().tobytes() for o, n in rows)
    assert checksum(arena, offsets, nbytes) == zlib.crc32(stream)
    first = checksum(arena, offsets[:1], nbytes[:1])
    assert checksum(arena, offsets[1:], nbytes[1:], first) == zlib.crc32(stream)


def test_staging_buffers_rotate_and_grow():
    staging = StagingBuffers(torch.device("cpu"))
    pointers = [staging.get(k, 100).data_ptr() for k in range(PIPELINE_DEPTH)]
    assert len(set(pointers)) == PIPELINE_DEPTH
    assert staging.get(PIPELINE_DEPTH, 50).data_ptr() == pointers[0]
    assert staging.get(1, 1000).shape == (1000,)


@st.composite
def piece_lists(draw) -> list[tuple[int, int]]:
    """Disjoint pieces in a random stream order: some adjacent in the arena (they coalesce), sizes
    and offsets multiples of a random unit (one indexed copy of rows) or odd (a copy per piece)."""
    unit = draw(st.sampled_from([1, 3, 64, 256, 1024]))
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=60))
    gaps = draw(st.lists(st.integers(0, 3), min_size=len(sizes), max_size=len(sizes)))
    rows, offset = [], 0
    for size, gap in zip(sizes, gaps, strict=True):
        offset += gap * unit
        rows.append((offset, size * unit))
        offset += size * unit
    order = draw(st.permutations(range(len(rows))))
    keep_runs = draw(st.booleans())  # in arena order: every adjacent pair coalesces
    return rows if keep_runs else [rows[i] for i in order]


@settings(max_examples=150, deadline=None)
@given(rows=piece_lists(), seed=st.integers(0, 1000))
def test_gather_and_scatter_match_a_copy_per_piece_for_any_pieces(rows, seed):
    assert_gather_and_scatter_copy_each_piece(
        random_arena(max(o + n for o, n in rows) + 17, seed=seed), rows, seed
    )


def assert_gather_and_scatter_copy_each_piece(
    arena: torch.Tensor, rows: list[tuple[int, int]], seed: int
) -> None:
    """`gather` packs the pieces `rows` of `arena` end to end, and `scatter` puts a packed buffer
    back: both as a copy per piece would."""
    offsets, nbytes = pieces(rows)
    out = torch.empty(int(nbytes.sum()), dtype=torch.uint8)
    gather(arena, offsets.numpy(), nbytes.numpy(), out)
    assert torch.equal(out, torch.cat([arena[o : o + n] for o, n in rows]))
    before, src = arena.clone(), random_arena(out.shape[0], seed=seed + 1)
    scatter(src, offsets.numpy(), nbytes.numpy(), arena)
    expected, position = before, 0
    for o, n in rows:
        expected[o : o + n] = src[position : position + n]
        position += n
    assert torch.equal(arena, expected)


def test_rows_too_narrow_for_their_index_are_copied_piece_by_piece(monkeypatch):
    monkeypatch.setattr(staging, "_MAX_NARROW_ROWS", 100)  # the odd case's 780 one-byte rows: too many
    arena = random_arena(64 * 1024, seed=6)
    offsets, nbytes = pieces(CASES["odd"])
    assert staging._piece_rows(offsets.numpy(), nbytes.numpy()) is None
    out = torch.empty(int(nbytes.sum()), dtype=torch.uint8)
    gather(arena, offsets, nbytes, out)
    assert torch.equal(out, torch.cat([arena[o : o + n] for o, n in CASES["odd"]]))


@st.composite
def strided_piece_lists(draw) -> list[tuple[int, int]]:
    """Stretches of pieces of one length at one stride (forwards, backwards, or back to back: they
    coalesce), one after another in the arena, with a lone piece now and then between them: the
    shape of KV-head slices across TP sizes."""
    rows, offset = [], draw(st.integers(0, 7))
    for _ in range(draw(st.integers(1, 4))):
        length = draw(st.sampled_from([1, 5, 64, 512]))
        gap = draw(st.sampled_from([0, 1, length, 3 * length + 2]))
        count = draw(st.integers(1, 120))
        stretch = [(offset + j * (length + gap), length) for j in range(count)]
        rows += stretch[::-1] if draw(st.booleans()) else stretch
        offset += count * (length + gap) + draw(st.integers(0, 9))
        if draw(st.booleans()):
            rows.append((offset, draw(st.integers(1, 300))))
            offset += rows[-1][1] + 1
    return rows


@settings(max_examples=150, deadline=None)
@given(rows=strided_piece_lists(), seed=st.integers(0, 1000))
def test_strided_stretches_gather_and_scatter_as_a_copy_per_piece(rows, seed):
    assert_gather_and_scatter_copy_each_piece(
        random_arena(max(o + n for o, n in rows) + 3, seed=seed), rows, seed
    )


def test_kv_head_slices_page_after_page_are_one_strided_segment():
    # 512-byte slices every 1,024 bytes over 64 back-to-back pages of 16 rows: one segment, and the
    # copy goes through it (no index of rows).
    offsets = np.arange(64 * 16, dtype=np.int64) * 1024 + 512
    nbytes = np.full(offsets.shape, 512, dtype=np.int64)
    assert strided_segments(offsets, nbytes).tolist() == [[0, 64 * 16, 1024]]
    # A stretch whose step changes starts a new segment (its first piece alone).
    jumped = np.concatenate([offsets[:10], offsets[10:] + 100])
    assert strided_segments(jumped, nbytes).tolist() == [[0, 10, 1024], [10, 1, 0], [11, 1013, 1024]]
    # Pieces with no common stride are too many segments: the indexed copy takes them.
    rng = np.random.default_rng(0)
    assert strided_segments(np.sort(rng.choice(1 << 20, 200, replace=False)) * 600, nbytes[:200]) is None
