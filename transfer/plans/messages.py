"""Runs into messages: the chunks and messages one transfer's stream goes as, and their streams.

`plan_messages` cuts the stream of runs (`transfer.plans.plan.plan_runs`, or a reshard pair's) into
chunks of `chunk_bytes` and each chunk into messages (`MessagePlan`: chunk by chunk, as an end asks
for them): each big run is a zero-copy message of its own, the small ones of a chunk are batched
into one message, staged on each side where its pieces are not contiguous (its long stretches back
to back on one side going as messages of their own where that copies less), and spreads the
messages over the channel's connections (`MessagePlan.streams`). Both ends compute the same messages from the
same runs and the header's two sizes, so no per-message metadata travels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

import numpy as np

from distpool.memory.arena import DST, NBYTES, SRC


class Message(NamedTuple):
    """One message on the wire, filled by `pieces` (k, 3) runs in order.

    Each side moves the message in place (zero copy) where its pieces are contiguous in that
    side's arena, and through a staging buffer elsewhere: the sender gathers, the receiver
    scatters. A message of one piece is in place on both sides; a batched one may be in place on
    one side only (say, scattered pages at the source landing in a contiguous reservation).

    A named tuple: every transfer makes one per message on each end before its first byte moves
    (a scattered envelope's pages go one message each), and a frozen dataclass took ~2 us to make,
    most of planning a thousand scattered pages.
    """

    pieces: np.ndarray  # (k, 3) int64: src_offset, dst_offset, nbytes
    nbytes: int
    spans: tuple[int | None, int | None]  # per side (SRC, DST): arena offset if contiguous there

    @property
    def is_direct(self) -> bool:
        return self.pieces.shape[0] == 1

    def in_place_at(self, side: int) -> int | None:
        """The arena offset where the message lies on `side` (SRC or DST), or None where it is staged."""
        return self.spans[side]


def _message(pieces: np.ndarray, in_place: np.ndarray) -> Message:
    """The message of `pieces` (k, 3), with `_in_place(pieces)` (known already to the caller)."""
    first = pieces[0].tolist()
    spans = (first[SRC] if in_place[0] else None, first[DST] if in_place[1] else None)
    return Message(pieces=pieces, nbytes=int(pieces[:, NBYTES].sum()), spans=spans)


@dataclass(frozen=True)
class Chunk:
    """The messages for one `chunk_bytes` window of the stream; the unit of pipelining.

    The messages staged on one side lie back to back, in plan order, in one staging buffer of the
    chunk (`staging_offsets`): together they hold at most `chunk_bytes`.
    """

    index: int
    messages: tuple[Message, ...]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.messages)

    def staging_offsets(self, side: int) -> list[int | None]:
        """Per message, where it lies in the chunk's staging buffer on `side` (None: in place there)."""
        offsets, position = [], 0
        for message in self.messages:
            if message.in_place_at(side) is None:
                offsets.append(position)
                position += message.nbytes
            else:
                offsets.append(None)
        return offsets

    def staged_bytes(self, side: int) -> int:
        return sum(m.nbytes for m in self.messages if m.in_place_at(side) is None)


def _split_at_chunks(runs: np.ndarray, chunk_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Cut runs where the stream crosses a multiple of `chunk_bytes`: (pieces, chunk of each piece,
    pieces per run or None where no run is cut). Only the few runs that straddle a boundary (at
    most one per chunk) are cut; every other run is a piece as it is."""
    nbytes = runs[:, NBYTES]
    ends = np.cumsum(nbytes)  # (m,) stream offset past each run
    starts = ends - nbytes
    first_chunk, last_chunk = starts // chunk_bytes, (ends - 1) // chunk_bytes
    cut = np.flatnonzero(last_chunk != first_chunk)
    if cut.size == 0:
        return runs, first_chunk, None
    count = np.ones(runs.shape[0], dtype=np.int64)
    count[cut] = last_chunk[cut] - first_chunk[cut] + 1
    pieces, chunk_of_piece = np.repeat(runs, count, axis=0), np.repeat(first_chunk, count)
    # The cut runs' pieces, vectorised over those runs alone: piece j of a run lies in its chunk
    # first + j, from the later of the run's start and that chunk's start.
    cut_count = count[cut]
    extra = np.cumsum(cut_count - 1)  # pieces the cut runs up to each one add
    at = cut + extra - (cut_count - 1)  # where each cut run's first piece sits in `pieces`
    run = np.repeat(cut, cut_count)
    nth = np.arange(run.size) - np.repeat(np.cumsum(cut_count) - cut_count, cut_count)
    rows = np.repeat(at, cut_count) + nth
    chunk = first_chunk[run] + nth
    piece_start = np.maximum(starts[run], chunk * chunk_bytes)
    piece_end = np.minimum(ends[run], (chunk + 1) * chunk_bytes)
    delta = piece_start - starts[run]
    pieces[rows, SRC] = runs[run, SRC] + delta
    pieces[rows, DST] = runs[run, DST] + delta
    pieces[rows, NBYTES] = piece_end - piece_start
    chunk_of_piece[rows] = chunk
    return pieces, chunk_of_piece, count


_ROW = np.dtype((np.void, 3 * 8))  # one (src, dst, nbytes) int64 row as a single element


def _select_rows(table: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """`table[keep]` for an (k, 3) int64 table and a (k,) bool mask, the rows moved as 24-byte
    elements (numpy's boolean indexing of a 2-D table goes element by element: ~8x slower)."""
    rows = np.ascontiguousarray(table).view(_ROW)[:, 0]
    return rows[keep].view(np.int64).reshape(-1, 3)


def _in_place(pieces: np.ndarray) -> np.ndarray:
    """(2,) bool: whether `pieces` (k, 3), sent as one message, lie back to back at SRC and at DST."""
    if pieces.shape[0] == 1:
        return np.ones(2, dtype=bool)
    lengths = pieces[:-1, NBYTES]
    return np.array(
        [
            np.array_equal(pieces[1:, SRC], pieces[:-1, SRC] + lengths),
            np.array_equal(pieces[1:, DST], pieces[:-1, DST] + lengths),
        ]
    )


def _copied_bytes(pieces: np.ndarray, in_place: np.ndarray) -> int:
    """Bytes a batched message of `pieces` copies through staging: its bytes, once per side where it
    is not in place (a gather at the source, a scatter at the destination)."""
    return int(pieces[:, NBYTES].sum()) * int((~in_place).sum())


def _goes_direct(
    pieces: np.ndarray, candidates: np.ndarray, message_cost_bytes: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Which pieces of one chunk are sent zero-copy: the `candidates` (pieces of long runs), unless
    batching them with the rest costs less. Cost, in bytes copied: each message counts
    `message_cost_bytes`, and a batch counts its bytes once per side it is staged on. Batching
    wins where it keeps a side in place that splitting would break (say, a contiguous source whose
    long runs would leave gaps in the batch). Ties go zero-copy. Also returns the batch's
    `_in_place` (None when nothing is batched)."""
    if not candidates.any():
        return candidates, _in_place(pieces)
    if candidates.shape[0] == 1:
        return candidates, None  # one piece is in place on both sides either way
    rest = _select_rows(pieces, ~candidates)
    rest_in_place = _in_place(rest) if rest.shape[0] else None
    split = message_cost_bytes * (int(candidates.sum()) + int(rest_in_place is not None))
    if rest_in_place is not None:
        split += _copied_bytes(rest, rest_in_place)
    all_in_place = _in_place(pieces)
    batched = message_cost_bytes + _copied_bytes(pieces, all_in_place)
    return (candidates, rest_in_place) if split <= batched else (np.zeros_like(candidates), all_in_place)


def _split_by_stretches(batch: np.ndarray, message_cost_bytes: int) -> list[Message] | None:
    """A batch staged on both sides, with its long stretches of pieces back to back on one side (the
    side with fewer stretches) taken out: each goes as a message of its own, staged on the other side
    only; the other pieces stay one batch, staged on both sides, sent first. None where that costs
    more. Cost as in `_goes_direct`: a stretch goes alone where its bytes, copied once instead of
    twice, outweigh one more message (say, the slices of a page stretch of TP 2 -> 1 alone, the
    small conv-state halves between state halves sent zero-copy still batched)."""
    lengths = batch[:-1, NBYTES]
    starts = [
        np.flatnonzero(np.concatenate([[True], batch[1:, side] != batch[:-1, side] + lengths]))
        for side in (SRC, DST)
    ]
    side = SRC if starts[SRC].size <= starts[DST].size else DST
    stretch_bytes = np.add.reduceat(batch[:, NBYTES], starts[side])
    alone = stretch_bytes > message_cost_bytes
    num_alone, alone_bytes = int(alone.sum()), int(stretch_bytes[alone].sum())
    rest = num_alone < alone.size  # some stretches stay in the batch
    if (num_alone + rest - 1) * message_cost_bytes >= alone_bytes:
        return None
    bounds = [*starts[side].tolist(), batch.shape[0]]
    stretches = [batch[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    messages = []
    if rest:
        kept = np.concatenate(
            [stretch for stretch, long in zip(stretches, alone.tolist(), strict=True) if not long]
        )
        messages.append(_message(kept, _in_place(kept)))
    return messages + [
        _message(stretch, _in_place(stretch))
        for stretch, long in zip(stretches, alone.tolist(), strict=True)
        if long
    ]


def plan_messages(runs: np.ndarray, *, chunk_bytes: int, direct_min_bytes: int) -> list[Chunk]:
    """Cut the stream of `runs` into chunks of `chunk_bytes` and each chunk into messages.

    Runs are split where the stream crosses a multiple of `chunk_bytes`. In each chunk, the pieces
    of runs of at least `direct_min_bytes` are each a zero-copy message of their own, unless one
    batch of the whole chunk copies fewer bytes (`_goes_direct`, with `direct_min_bytes` as what
    one message costs); all the other pieces are batched, in stream order, into one message (sent
    first, so that a gather of it starts early). A batch staged on both sides sends instead its long
    stretches back to back on one side as messages of their own, where that copies their bytes
    once for less (`_split_by_stretches`). Both ends decide alike: a pure function of the runs and
    the header's two sizes. Every chunk at once; `MessagePlan` plans them as they are asked for.
    """
    return list(MessagePlan(runs, chunk_bytes=chunk_bytes, direct_min_bytes=direct_min_bytes))


class MessagePlan(Sequence[Chunk]):
    """`plan_messages`'s chunks, each planned the first time it (or a later one) is asked for, and
    their messages' streams (`streams`). An end posts chunk 0's
    messages before it plans the others, which the first bytes then overlap: planning a chunk of
    ~85 scattered pages takes ~0.1 ms here (~1 ms for a 1,024-page envelope whole), and on the
    receiving side it stood between the header and the first posted receive. `len` is known at
    once."""

    def __init__(
        self, runs: np.ndarray, *, chunk_bytes: int, direct_min_bytes: int, num_streams: int = 1
    ) -> None:
        if chunk_bytes <= 0 or direct_min_bytes <= 0:
            raise ValueError(
                f"chunk_bytes ({chunk_bytes}) and direct_min_bytes ({direct_min_bytes}) must be > 0"
            )
        if num_streams < 1:
            raise ValueError(f"num_streams ({num_streams}) must be >= 1")
        self.direct_min_bytes = direct_min_bytes
        self._chunks: list[Chunk] = []
        self._streams: list[list[int]] = []
        self._loads = [0] * num_streams
        runs = np.asarray(runs, dtype=np.int64)
        if runs.shape[0] == 0:  # across TP, a pair may move nothing of an envelope: the stream is empty
            self._num_chunks, self._bounds = 0, [0]
            return
        self._pieces, chunk_of_piece, count = _split_at_chunks(runs, chunk_bytes)
        direct = runs[:, NBYTES] >= direct_min_bytes  # a piece of a long run goes as that run does
        self._direct = direct if count is None else np.repeat(direct, count)
        self._num_chunks = int(chunk_of_piece[-1]) + 1
        self._bounds = np.searchsorted(chunk_of_piece, np.arange(self._num_chunks + 1)).tolist()

    def __len__(self) -> int:
        return self._num_chunks

    @property
    def planned(self) -> int:
        """How many chunks (the first ones) are planned so far."""
        return len(self._chunks)

    @overload
    def __getitem__(self, index: int) -> Chunk: ...

    @overload
    def __getitem__(self, index: slice) -> list[Chunk]: ...

    def __getitem__(self, index: int | slice) -> Chunk | list[Chunk]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._num_chunks))]
        if not -self._num_chunks <= index < self._num_chunks:
            raise IndexError(f"chunk {index} of a plan of {self._num_chunks}")
        index %= self._num_chunks
        while len(self._chunks) <= index:
            self._plan_next()
        return self._chunks[index]

    def streams(self, index: int) -> list[int]:
        """The stream of each message of chunk `index`."""
        self[index]
        return self._streams[index]

    def _plan_next(self) -> None:
        index = len(self._chunks)
        lo, hi = self._bounds[index], self._bounds[index + 1]
        in_chunk, cost = self._pieces[lo:hi], self.direct_min_bytes
        is_direct, batch_in_place = _goes_direct(in_chunk, self._direct[lo:hi], cost)
        messages = []
        any_direct = bool(is_direct.any())
        if batch_in_place is not None:
            batch = _select_rows(in_chunk, ~is_direct) if any_direct else in_chunk
            split = None if batch_in_place.any() else _split_by_stretches(batch, cost)
            messages = split or [_message(batch, batch_in_place)]
        if any_direct:
            direct_pieces = _select_rows(in_chunk, is_direct)
            messages += [  # one piece: in place on both sides (rows of a (n, 1, 3) view: no slicing)
                Message(piece, n, (src, dst))
                for piece, (src, dst, n) in zip(direct_pieces[:, None], direct_pieces.tolist(), strict=True)
            ]
        chunk = Chunk(index=index, messages=tuple(messages))
        self._chunks.append(chunk)
        self._streams.append(_assign(self._loads, chunk))


def _assign(loads: list[int], chunk: Chunk) -> list[int]:
    """The streams of `chunk`'s messages, given each stream's bytes so far (`loads`, updated): each
    goes to the stream with the fewest bytes so far (ties to the lowest), so parallel connections
    carry even shares even when one run is large. Both ends compute it from the same plan, so
    message i of a stream matches on both sides."""
    row = []
    for message in chunk.messages:
        stream = loads.index(min(loads))
        loads[stream] += message.nbytes
        row.append(stream)
    return row
