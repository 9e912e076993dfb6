"""Strided segments of a piece list: stretches of pieces of one length at one stride in the arena.

A heterogeneous-TP plan cuts every page into KV-head runs: on the side that holds more heads, the
runs a rank pair moves are one length apart by one stride (a page keeps each layer's K and V heads
outermost, so at Bamba 2 -> 1 a rank's heads of a K or V are 16 KiB every 32 KiB), page after
page. Such a stretch is one strided view of the arena, copied to or from its place in the packed
buffer by one numpy copy (~10 GB/s on CPU even for 512-byte pieces, where an indexed copy of
512-byte rows moves ~7 GB/s), rather than by an index of its rows.

    strided_segments(offsets, nbytes) -> (first piece, count, stride) per segment, in order, or
                                         None when the pieces form too many segments to pay off
    copy_segments(arena, ...)         -> the copy, segment by segment (numpy views of CPU tensors)
"""

from __future__ import annotations

import numpy as np
import torch

# A piece list of k pieces goes segment by segment when it forms at most this share of k segments
# (each segment costs a few microseconds of Python; a piece of an indexed copy well under one).
_MAX_SEGMENTS_SHARE = 1 / 16
_MAX_SEGMENTS_ALWAYS = 8


def strided_segments(offsets: np.ndarray, nbytes: np.ndarray) -> np.ndarray | None:
    """(s, 3) int64 rows (first piece, count, stride): consecutive pieces of one length whose
    offsets step by one stride, covering the pieces in order; None when there are more than
    max(8, k / 16) of them. A segment of one piece has stride 0."""
    k = offsets.shape[0]
    if k == 0:
        return np.zeros((0, 3), dtype=np.int64)
    step = np.diff(offsets)  # (k - 1,) step[i - 1]: from piece i - 1 to piece i
    # Piece i continues the segment of piece i - 1 when it has that piece's length and either
    # piece i - 1 starts its segment (any step: the stride is set by the second piece) or the
    # step repeats. Decided left to right, that depends on where segments start; a vectorised
    # rule close to it: piece i starts a segment where its length changes, or where its step
    # differs from the step before it (then the second piece of a new segment also starts one,
    # a segment of one piece: a slice copy).
    starts = np.ones(k, dtype=bool)
    if k > 1:
        same_len = nbytes[1:] == nbytes[:-1]
        same_step = np.concatenate([[True], step[1:] == step[:-1]])
        starts[1:] = ~(same_len & same_step)
    first = np.flatnonzero(starts)
    if first.size > max(_MAX_SEGMENTS_ALWAYS, k * _MAX_SEGMENTS_SHARE):
        return None
    count = np.diff(np.append(first, k))
    stride = np.zeros_like(first)
    several = count > 1
    stride[several] = offsets[first[several] + 1] - offsets[first[several]]
    return np.stack([first, count, stride], axis=1)


def _strided_view(flat: np.ndarray, start: int, count: int, length: int, stride: int) -> np.ndarray:
    """(count, length) view of `flat`: row j at start + j * stride (stride may be negative)."""
    if count == 1:
        return flat[start : start + length].reshape(1, length)
    low = start if stride > 0 else start + (count - 1) * stride
    high = low + (count - 1) * abs(stride) + length
    if low < 0 or high > flat.shape[0]:
        raise ValueError("a piece lies past the end of the arena")
    rows = np.lib.stride_tricks.as_strided(flat[low:high], shape=(count, length), strides=(abs(stride), 1))
    return rows if stride > 0 else rows[::-1]


def copy_segments(
    arena: torch.Tensor,
    offsets: np.ndarray,
    nbytes: np.ndarray,
    segments: np.ndarray,
    packed: torch.Tensor,
    *,
    into_arena: bool,
) -> None:
    """Move the pieces between the CPU `arena` and the end-to-end `packed` buffer, one numpy copy
    per segment of `strided_segments(offsets, nbytes)`."""
    flat, out = arena.numpy(), packed.numpy()
    position = 0
    for first, count, stride in segments.tolist():
        length = int(nbytes[first])
        rows = _strided_view(flat, int(offsets[first]), count, length, stride)
        block = out[position : position + count * length].reshape(count, length)
        if into_arena:
            np.copyto(rows, block)
        else:
            np.copyto(block, rows)
        position += count * length
