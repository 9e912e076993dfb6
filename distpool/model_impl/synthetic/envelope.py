"""The synthetic pattern laid over a pool: which rows a request holds, writing them, verifying them.

Rows are addressed through the pool's own views (no copies): a KV tensor as (num_pages, page_size,
kv_heads, units) (`pattern.as_units`: a token's heads lie apart in a page) and a state tensor as
(num_slots, rows, row bytes) (`pattern.state_rows`: a slot's layers interleave a tensor's rows).
Writes are batched: one indexed write per layer, tensor and chunk of positions for a whole batch.
A pool of one tensor-parallel rank holds that rank's shard (`distpool.model.shard.RankShard`): its
rows are laid over the unsharded rows through a `RowMap`, so shards of any TP size verify.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from distpool.memory.pool import Pool
from distpool.model.shard import RankShard
from distpool.model.spec import ModelSpec
from distpool.model_impl.errors import ShardMismatch
from distpool.model_impl.pool_model import Mismatch
from distpool.model_impl.synthetic.pattern import (
    as_units,
    prefix_hashes,
    put_unit_rows,
    read_state,
    row_hashes,
    spread,
    state_rows,
    stream_key,
    stripe_writers,
    unit_rows,
    write_state_bytes,
)
from distpool.model_impl.synthetic.row_map import RowMap

CHUNK_POSITIONS = 4096  # KV rows generated at once: bounds the temporary memory of a long prompt
KV_KINDS = ("kv", "swa_kv")  # full attention, sliding window
_STREAM_PREFIX = {"kv": "", "swa_kv": "swa_"}  # stream names: k / v, swa_k / swa_v

# (layer, tensor name, units, (pages, rows) on the device, chunk start, expected rows (n, words))
_KvChunk = tuple[int, str, torch.Tensor, tuple[torch.Tensor, torch.Tensor], int, torch.Tensor]


def _first_diff(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Byte offset of the first byte where two 1-D word tensors differ."""
    return int((actual.view(torch.uint8) != expected.view(torch.uint8)).nonzero()[0])


class EnvelopePattern:
    """Writes and verifies the pattern of (spec, seed) in pools on `device`; caches per-stream bases.

    With `shard`, the pools hold that TP rank's shard of `spec` (built from `shard.spec`)."""

    def __init__(
        self, spec: ModelSpec, *, seed: int, device: torch.device, shard: RankShard | None = None
    ) -> None:
        if shard is not None and shard.model != spec:
            raise ShardMismatch(
                "model",
                spec.source,
                shard.model.source,
                f"the shard is of another model ({shard.model.source}) than the cache's ({spec.source})",
            )
        self.spec = spec
        self.seed = seed
        self.device = device
        self.shard = shard
        self._bases: dict[tuple[int, str], tuple[int, torch.Tensor]] = {}  # (layer, what) -> key, base
        self._row_maps: dict[str, RowMap] = {}  # tensor name -> where the pool's rows lie

    # ---- where rows live ------------------------------------------------------------------------
    def layers(self, kind: str) -> tuple[int, ...]:
        return self.spec.full_attention_layers if kind == "kv" else self.spec.sliding_window_layers

    def kv_kinds(self) -> list[str]:
        """The KV kinds this model has."""
        return [kind for kind in KV_KINDS if self.layers(kind)]

    def held_positions(self, pool: Pool, request_id: str, kind: str, num_tokens: int) -> np.ndarray:
        """Positions among the first `num_tokens` whose rows the pool keeps (a window drops some)."""
        first = pool.swa_first_page(request_id) * pool.page_size if kind == "swa_kv" else 0
        return np.arange(first, num_tokens)

    def places(
        self, pool: Pool, request_id: str, kind: str, positions: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(physical page id, row within the page) of each token position."""
        if kind == "kv":
            ids, first_page = pool.page_ids(request_id), 0
        else:
            ids, first_page = pool.swa_page_ids(request_id), pool.swa_first_page(request_id)
        at = torch.from_numpy(positions).to(torch.int64)
        return ids.cpu()[at // pool.page_size - first_page], at % pool.page_size

    def _row_map(self, name: str, view: torch.Tensor, lead_dims: int) -> RowMap:
        """Where the pool's rows of tensor `name` lie in the unsharded rows (checked against the pool)."""
        row_bytes = math.prod(view.shape[lead_dims:]) * view.element_size()
        if name not in self._row_maps:
            if self.shard is None:
                self._row_maps[name] = RowMap.whole(row_bytes)
            else:
                tensor = self.shard.tensor(name)
                self._row_maps[name] = RowMap(row_bytes=tensor.row_bytes, pieces=tensor.byte_pieces())
                if self._row_maps[name].nbytes != row_bytes:
                    raise ShardMismatch(
                        name,
                        tensor.nbytes,
                        row_bytes,
                        f"the pool holds {row_bytes} bytes per row of {name}, but rank {self.shard.rank} "
                        f"of TP {self.shard.tp} holds {tensor.nbytes}",
                    )
        row_map = self._row_maps[name]
        if row_map.nbytes != row_bytes:
            raise ValueError(
                f"rows of {name} hold {row_bytes} bytes in this pool, {row_map.nbytes} in the last one"
            )
        return row_map

    def _check_device(self, view: torch.Tensor) -> None:
        if view.device != self.device:
            raise ValueError(f"the pool is on {view.device} but the synthetic cache on {self.device}")

    def _state_rows(self, view: torch.Tensor) -> torch.Tensor:
        self._check_device(view)
        return state_rows(view)

    def _stream(self, layer: int, what: str, row_map: RowMap) -> tuple[int, torch.Tensor]:
        """(key, base words) of one stream, built on first use."""
        if (layer, what) not in self._bases:
            key = stream_key(self.seed, layer, what)
            self._bases[layer, what] = (key, row_map.base(key, self.device))
        return self._bases[layer, what]

    def _phases(self, row_map: RowMap, start: int, stop: int) -> torch.Tensor | None:
        """Unsharded byte phases of words [start, stop) of a row (None for int64 words)."""
        return None if row_map.word_dtype == torch.int64 else row_map.phases(start, stop, self.device)

    # ---- KV rows --------------------------------------------------------------------------------
    def _kv_chunks(
        self, pool: Pool, kind: str, pages: torch.Tensor, rows: torch.Tensor, hashes: np.ndarray
    ) -> Iterator[_KvChunk]:
        """Expected rows for `hashes` (H_{p+1} of each row's position p), per layer, K/V and chunk."""
        chunks = []
        for start in range(0, len(hashes), CHUNK_POSITIONS):
            stop = start + CHUNK_POSITIONS
            chunks.append((start, (pages[start:stop].to(self.device), rows[start:stop].to(self.device))))
        for layer in self.layers(kind):
            view = pool.kv_view(layer) if kind == "kv" else pool.swa_kv_view(layer)
            for name, tensor in zip("kv", view, strict=True):
                if tensor.numel() == 0:
                    continue  # MLA caches no V
                what = _STREAM_PREFIX[kind] + name  # also the tensor's name in a shard
                row_map = self._row_map(what, tensor, 2)
                self._check_device(tensor)
                units = as_units(tensor)  # (num_pages, page_size, kv_heads, units)
                key, base = self._stream(layer, what, row_map)
                phases = self._phases(row_map, 0, base.numel())
                for start, where in chunks:
                    mixed = row_hashes(key, hashes[start : start + CHUNK_POSITIONS])
                    expected = base ^ spread(mixed, phases, self.device)
                    yield layer, name, units, where, start, expected

    def write_kv(
        self, pool: Pool, kind: str, pages: torch.Tensor, rows: torch.Tensor, hashes: np.ndarray
    ) -> None:
        """Write the rows at (pages, rows) of every layer of `kind`; `hashes` are their H_{p+1}."""
        for _, _, units, where, _, expected in self._kv_chunks(pool, kind, pages, rows, hashes):
            put_unit_rows(units, where, expected)

    def _verify_kv(
        self, pool: Pool, request_id: str, kind: str, hashes: np.ndarray, num_tokens: int
    ) -> Mismatch | None:
        positions = self.held_positions(pool, request_id, kind, num_tokens)
        pages, rows = self.places(pool, request_id, kind, positions)
        for layer, name, units, where, start, expected in self._kv_chunks(
            pool, kind, pages, rows, hashes[positions + 1]
        ):
            actual = unit_rows(units, where, expected.dtype)  # (n, words), a copy
            if torch.equal(actual, expected):  # the common case, without a mask of every word
                continue
            bad = (actual != expected).any(dim=1)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                byte = _first_diff(actual[i], expected[i])
                return Mismatch(
                    kind=kind, layer=layer, tensor=name, position=int(positions[start + i]), byte_offset=byte
                )
        return None

    # ---- state ----------------------------------------------------------------------------------
    def _states(self, pool: Pool) -> Iterator[tuple[int, str, torch.Tensor, RowMap, int, torch.Tensor]]:
        """(layer, tensor name, (num_slots, rows, row bytes) (`state_rows`), row map, key, base) of
        every state tensor."""
        if self.spec.mamba is None:
            return
        names = [t.name for t in self.spec.mamba.tensors]
        for layer in self.spec.mamba_layers:
            for name, view in zip(names, pool.state_view(layer), strict=True):
                if view.numel():
                    row_map = self._row_map(name, view, 1)
                    rows = self._state_rows(view)
                    yield layer, name, rows, row_map, *self._stream(layer, f"state.{name}", row_map)

    def _pattern(self, key: int, prefix_hash: int, row_map: RowMap, start: int, stop: int) -> torch.Tensor:
        """Words [start, stop) of a state tensor's hash for `prefix_hash` (broadcasts over them)."""
        mixed = row_hashes(key, np.array([prefix_hash], dtype=np.uint64))
        return spread(mixed, self._phases(row_map, start, stop), self.device)[0]

    def write_state(self, pool: Pool, slot: int | None, prefix_hash: int, *, stripe: int | None) -> None:
        """Write `prefix_hash`'s pattern over the whole of physical slot `slot` (`stripe` None), or over
        stripe (`stripe` mod the tensor's stripe count) of each state tensor. No-op without state."""
        for _, _, rows, row_map, key, base in self._states(pool):
            bounds = row_map.stripe_bounds  # stripes of the unsharded tensor
            start, stop = (0, base.numel()) if stripe is None else bounds[stripe % len(bounds)]
            if start < stop:
                pattern = self._pattern(key, prefix_hash, row_map, start, stop)
                words = torch.bitwise_xor(base[start:stop], pattern)
                write_state_bytes(rows, slot, start * base.element_size(), words)

    def verify_state(
        self, pool: Pool, slot: int | None, hashes: np.ndarray, prompt_len: int, num_tokens: int
    ) -> Mismatch | None:
        """The first wrong byte of physical slot `slot`, written by a prefill of `prompt_len` tokens
        then decode steps up to `num_tokens` (`hashes`: H_0..H_num_tokens at least); a checkpoint
        after k tokens is a prefill of k: prompt_len = num_tokens = k."""
        for layer, name, rows, row_map, key, base in self._states(pool):
            bounds = row_map.stripe_bounds
            expected = torch.empty_like(base)
            writers = stripe_writers(prompt_len, num_tokens, len(bounds))
            for (start, stop), writer in zip(bounds, writers, strict=True):
                if start == stop:
                    continue  # a stripe of the unsharded tensor that this rank holds none of
                pattern = self._pattern(key, int(hashes[writer]), row_map, start, stop)
                torch.bitwise_xor(base[start:stop], pattern, out=expected[start:stop])
            actual = read_state(rows, slot, base.dtype)
            if not torch.equal(actual, expected):
                byte = _first_diff(actual, expected)
                return Mismatch(kind="state", layer=layer, tensor=name, position=None, byte_offset=byte)
        return None

    # ---- a whole envelope -----------------------------------------------------------------------
    def verify(self, pool: Pool, request_id: str, tokens: Sequence[int], prompt_len: int) -> Mismatch | None:
        """The first wrong byte of the envelope of a request whose first `len(tokens)` positions hold
        `tokens`, prefilled with `prompt_len` of them: state first, then KV by kind and layer."""
        hashes = prefix_hashes(tokens)
        mismatch = self.verify_state(pool, pool.slot_id(request_id), hashes, prompt_len, len(tokens))
        for kind in self.kv_kinds():
            if mismatch is None:
                mismatch = self._verify_kv(pool, request_id, kind, hashes, len(tokens))
        return mismatch
