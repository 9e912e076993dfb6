"""Gather and scatter between an arena and contiguous buffers, and the integrity checksum.

A *piece list* is two (k,) int64 arrays (numpy, or CPU tensors), byte offsets into the arena and
byte counts, in stream order. `gather` packs the pieces end to end into a contiguous buffer;
`scatter` does the reverse.

How the copy runs depends on the pieces, not on the caller. First, pieces that follow each other
in the arena merge (the packed side is contiguous anyway): a batch whose pieces are adjacent on this
side, but not on the other, moves as one slice here. Then:
- few or large pieces (8 at most, or 64 KiB a piece on average on CPU, 1 MiB on CUDA): one slice
  copy per piece (at most 512 for a 32 MiB chunk);
- many small pieces in a few strided stretches (KV-head runs of pages across TP sizes, on CPU):
  one numpy copy per stretch, through a strided view of the arena (`transfer.ends.segments`);
- other many small pieces: one vectorised indexed copy. The arena is viewed as rows of `unit` bytes, the
  gcd of every offset and count, so each piece is a whole number of rows (a copy per piece only
  where rows under 64 bytes would need an index of over a million rows); on CPU this goes through
  numpy (single-threaded: torch's intra-op threads spin and starve the Gloo I/O threads on a small
  machine), on CUDA through torch index_select / index_copy_.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import numpy as np
import torch

from transfer.ends.segments import copy_segments, strided_segments

# Below this many pieces, or above this mean piece size, a loop of slice copies costs less than one
# indexed copy. On CPU a slice copy costs ~1-2 us beyond its bytes, and numpy's indexed copy moves
# ~6-7 GB/s whatever the row width, where a slice copy of 64 KiB moves ~10 GB/s and one of 4 KiB
# ~3 GB/s (2 cores, load ~6, interleaved medians): from 64 KiB a piece, the loop goes (at most 512
# copies for a 32 MiB chunk). On CUDA every slice copy is a kernel launch: only from 1 MiB.
_LOOP_MAX_PIECES = 8
_LOOP_MIN_MEAN_BYTES = {"cpu": 64 << 10, "cuda": 1 << 20}
# Rows narrower than this make the index larger than 1/8 of the data it moves: taken only while the
# index stays under _MAX_NARROW_ROWS entries (8 MiB), else a copy per piece.
_MIN_UNIT_BYTES = 64
_MAX_NARROW_ROWS = 1 << 20


def _piece_rows(offsets: np.ndarray, nbytes: np.ndarray) -> tuple[int, np.ndarray] | None:
    """The row width and row index that cover the pieces, or None when rows would be too narrow."""
    unit = int(np.gcd.reduce(np.concatenate([offsets, nbytes])))
    if unit < _MIN_UNIT_BYTES and int(nbytes.sum()) // unit > _MAX_NARROW_ROWS:
        return None
    rows_per_piece = nbytes // unit
    first_row = offsets // unit
    if bool((rows_per_piece == 1).all()):
        return unit, first_row
    starts = np.repeat(np.cumsum(rows_per_piece) - rows_per_piece, rows_per_piece)
    rows = np.repeat(first_row, rows_per_piece) + (np.arange(int(rows_per_piece.sum())) - starts)
    return unit, rows


def _coalesce(offsets: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge each piece into the one before it where it starts at that one's end (same packed order)."""
    follows = offsets[1:] == offsets[:-1] + nbytes[:-1]
    if not follows.any():
        return offsets, nbytes
    first = np.flatnonzero(np.concatenate([[True], ~follows]))
    return offsets[first], np.add.reduceat(nbytes, first)


def _use_loop(offsets: np.ndarray, nbytes: np.ndarray, device_type: str) -> bool:
    min_mean = _LOOP_MIN_MEAN_BYTES.get(device_type, _LOOP_MIN_MEAN_BYTES["cuda"])
    return len(offsets) <= _LOOP_MAX_PIECES or int(nbytes.sum()) >= min_mean * len(offsets)


def _as_rows_np(buf: torch.Tensor, unit: int) -> np.ndarray:
    # A void dtype of `unit` bytes needs no alignment, so any arena can be viewed this way.
    flat = buf.numpy()
    return flat[: (flat.shape[0] // unit) * unit].view(np.dtype((np.void, unit)))


def _as_rows_torch(buf: torch.Tensor, unit: int) -> torch.Tensor:
    return buf[: (buf.shape[0] // unit) * unit].view(-1, unit)  # (num_rows, unit) uint8


def gather(arena: torch.Tensor, offsets: np.ndarray, nbytes: np.ndarray, out: torch.Tensor) -> None:
    """Copy the pieces of `arena` end to end into `out` (1-D uint8, exactly sum(nbytes) bytes)."""
    _copy(arena, offsets, nbytes, out, into_arena=False)


def scatter(src: torch.Tensor, offsets: np.ndarray, nbytes: np.ndarray, arena: torch.Tensor) -> None:
    """Copy `src` (1-D uint8, sum(nbytes) bytes) into the pieces of `arena`, in order."""
    _copy(arena, offsets, nbytes, src, into_arena=True)


def _copy(
    arena: torch.Tensor, offsets: np.ndarray, nbytes: np.ndarray, packed: torch.Tensor, *, into_arena: bool
) -> None:
    """Move bytes between the pieces of `arena` and the end-to-end `packed` buffer, either way:
    a loop per piece when pieces are few or large, else one indexed copy of equal-width rows."""
    off_np, len_np = np.asarray(offsets, dtype=np.int64), np.asarray(nbytes, dtype=np.int64)
    if packed.shape[0] != int(len_np.sum()):
        raise ValueError(f"a packed buffer of {packed.shape[0]} bytes for pieces of {int(len_np.sum())}")
    off_np, len_np = _coalesce(off_np, len_np)
    loop = _use_loop(off_np, len_np, arena.device.type)
    if not loop and arena.device.type == "cpu":
        segments = strided_segments(off_np, len_np)
        if segments is not None:
            copy_segments(arena, off_np, len_np, segments, packed, into_arena=into_arena)
            return
    rows = None if loop else _piece_rows(off_np, len_np)
    if rows is None:
        a, p = (arena.numpy(), packed.numpy()) if arena.device.type == "cpu" else (arena, packed)
        pos = 0
        for off, n in zip(off_np.tolist(), len_np.tolist(), strict=True):
            if into_arena:
                a[off : off + n] = p[pos : pos + n]
            else:
                p[pos : pos + n] = a[off : off + n]
            pos += n
        return
    unit, index = rows
    if arena.device.type == "cpu":
        arena_rows, packed_rows = _as_rows_np(arena, unit), _as_rows_np(packed, unit)
        # check_ranges validated every piece against the arena; this keeps that promise visible,
        # since np.take's fast mode="clip" would otherwise copy the last row for a bad index.
        if index.size and int(index.max()) >= arena_rows.shape[0]:
            raise ValueError("a piece lies past the end of the arena")
        if into_arena:
            arena_rows[index] = packed_rows
        else:
            np.take(arena_rows, index, axis=0, out=packed_rows, mode="clip")
    else:
        idx = torch.from_numpy(index).to(arena.device, non_blocking=True)
        arena_rows, packed_rows = _as_rows_torch(arena, unit), _as_rows_torch(packed, unit)
        if into_arena:
            arena_rows.index_copy_(0, idx, packed_rows)
        else:
            torch.index_select(arena_rows, 0, idx, out=packed_rows)


def checksum(arena: torch.Tensor, offsets: np.ndarray, nbytes: np.ndarray, value: int = 0) -> int:
    """CRC-32 of the pieces' bytes in order, continuing from `value` (chain calls across messages)."""
    if arena.device.type == "cpu":
        # Pieces adjacent here merge first (a CRC over their concatenation is the chained one): a
        # side where the runs lie back to back checksums them in one call, not one per run.
        offsets, nbytes = _coalesce(np.asarray(offsets, dtype=np.int64), np.asarray(nbytes, dtype=np.int64))
        flat = arena.numpy()
        for off, n in zip(offsets.tolist(), nbytes.tolist(), strict=True):
            value = zlib.crc32(flat[off : off + n], value)
        return value
    packed = torch.empty(int(np.sum(nbytes)), dtype=torch.uint8, device=arena.device)
    gather(arena, offsets, nbytes, packed)
    return zlib.crc32(packed.cpu().numpy(), value)


# Staging buffers per engine: chunk k uses buffer k % PIPELINE_DEPTH, so one chunk can be gathered
# (or scattered) while the two before it are on the wire.
PIPELINE_DEPTH = 3


class StagingBuffers:
    """PIPELINE_DEPTH reusable staging buffers on one device, each allocated on first use and grown on
    demand. Growing one buffer never touches the others: they may hold chunks still on the wire."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * PIPELINE_DEPTH

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        """Buffer `index % PIPELINE_DEPTH`, at least `nbytes` long, as a 1-D uint8 view."""
        slot = index % PIPELINE_DEPTH
        buffer = self._buffers[slot]
        if buffer is None or buffer.shape[0] < nbytes:
            buffer = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer[:nbytes]


class CopyStream:
    """Where the engine's copies run: a side stream on CUDA (off the model's stream), nothing on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event marking everything enqueued so far on the *caller's* stream (None on CPU)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_for(self, event: torch.cuda.Event | None) -> None:
        """Make later copies wait for `event` (e.g. the model's writes to the pages being sent)."""
        if self._stream is not None and event is not None:
            self._stream.wait_event(event)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
