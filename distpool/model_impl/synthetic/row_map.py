"""Where a rank's row of one tensor lies in the unsharded row, so the pattern is a function of the
unsharded tensor's bytes and a shard at any TP size holds exactly the bytes TP 1 holds there.

The pattern's byte g of an unsharded row is base[g] ^ hash_byte[g % 8] (`pattern.py`), and a decode
step rewrites stripes of the unsharded row's words. A rank's row is `pieces` of the unsharded row,
laid end to end in increasing order (`distpool.model.shard.TensorShard.byte_pieces`). At TP 1 the
row map is one piece, and every function here gives what the unsharded functions give.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from distpool.model_impl.synthetic.pattern import BASE_KEY, mix_one, splitmix64, stripe_bounds, word_dtype


@dataclass(frozen=True)
class RowMap:
    """A rank's row as [start, stop) byte ranges of the unsharded row of `row_bytes` bytes.

    Derived figures are cached: a decode step reads them for every state tensor."""

    row_bytes: int
    pieces: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        ends = [e for piece in self.pieces for e in piece]
        if ends != sorted(ends) or (ends and (ends[0] < 0 or ends[-1] > self.row_bytes)):
            raise ValueError(
                f"pieces {self.pieces} are not ordered ranges within a row of {self.row_bytes} bytes"
            )

    @classmethod
    def whole(cls, row_bytes: int) -> RowMap:
        return cls(row_bytes=row_bytes, pieces=((0, row_bytes),) if row_bytes else ())

    @property
    def nbytes(self) -> int:
        return sum(stop - start for start, stop in self.pieces)

    @cached_property
    def global_word_bytes(self) -> int:
        """Bytes per word of the unsharded row (its stripes are counted in these words)."""
        return word_dtype(self.row_bytes).itemsize

    @cached_property
    def word_dtype(self) -> torch.dtype:
        """int64 where every piece is whole words of the unsharded row, else bytes."""
        aligned = all(start % 8 == 0 and stop % 8 == 0 for start, stop in self.pieces)
        return torch.int64 if self.global_word_bytes == 8 and aligned else torch.uint8

    def base(self, key: int, device: torch.device) -> torch.Tensor:
        """The rank's words of a stream's base (bytes of splitmix64(word index + key'))."""
        offset = np.uint64(mix_one(key ^ BASE_KEY))
        parts = []
        for start, stop in self.pieces:
            first = start // 8
            words = splitmix64(np.arange(first, -(-stop // 8), dtype=np.uint64) + offset)
            parts.append(words.view(np.uint8)[start - 8 * first : stop - 8 * first])
        raw = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)
        return torch.from_numpy(raw.copy()).view(self.word_dtype).to(device)

    def phases(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Byte g % 8 of the unsharded row for the rank's bytes [start, stop) (byte words only)."""
        parts, at = [], 0
        for begin, end in self.pieces:
            lo, hi = max(start, at), min(stop, at + end - begin)
            if lo < hi:
                parts.append(torch.arange(begin + lo - at, begin + hi - at) % 8)
            at += end - begin
        return torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.int64, device=device)

    def _local(self, position: int) -> int:
        """The rank's byte offset of unsharded byte `position` (or of the next byte it holds)."""
        return sum(min(max(position - start, 0), stop - start) for start, stop in self.pieces)

    @cached_property
    def stripe_bounds(self) -> list[tuple[int, int]]:
        """Per stripe of the unsharded row, the rank's [start, stop) words of it (maybe empty)."""
        size = self.global_word_bytes
        local_size = self.word_dtype.itemsize
        bounds = []
        for start, stop in stripe_bounds(self.row_bytes // size):
            lo, hi = self._local(start * size), self._local(stop * size)
            if lo % local_size or hi % local_size:
                raise ValueError(f"{self}: stripe [{start}, {stop}) splits a word of {local_size} bytes")
            bounds.append((lo // local_size, hi // local_size))
        return bounds
