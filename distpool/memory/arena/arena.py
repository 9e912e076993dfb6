"""The arena: one `uint8` tensor holding every page and slot, and zero-copy per-layer views of it.

The arena owns bytes only; which position belongs to whom is the allocator's business.

    offset 0                                                                  arena_bytes
    | low band: units grow up ->   |   gap (frontier)   |  <- high band: pages grow down |
    | u0 | u1 | u2 | ...           |                    |  ... | p[P-3] | p[P-2] | p[P-1] |      |
    ^ low.base_bytes = 0                                ^ high.base_bytes + i * page_stride

- Low band units are Mamba slots (hybrid Mamba) or sliding-window pages (hybrid SWA); unit j sits at
  `j * low_stride`. High band units are full-attention pages; page i sits at
  `high.base_bytes + i * page_stride`, and page P-1 ends at the top of the arena.
- Unified: both bands span the whole usable region and overlap in bytes; the allocator only hands out
  a position that does not overlap a live unit of the other band, so the frontier moves at run time.
- Static: each band has its planned number of positions and the two never overlap (a fixed frontier).

A position index is the physical id: dim 0 of every view of a band is indexed by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from distpool.memory.errors import NotALayerOfKind
from distpool.memory.sizing import (
    ALIGN_BYTES,
    PoolSizes,
    TensorPlace,
    kv_page_shape,
    page_places,
    slot_places,
)
from distpool.model.dtypes import torch_dtype
from distpool.model.spec import AttentionSpec

SLIDE_STAGING_BYTES = 64 << 20  # largest piece of a sliding copy that goes through a staging buffer


@dataclass(frozen=True)
class BandGeometry:
    """Geometry of one band: `num_positions` units of `stride_bytes`, position 0 at `base_bytes`."""

    name: str  # what the units are: "slots", "swa_pages" or "pages"
    base_bytes: int
    stride_bytes: int
    num_positions: int

    @property
    def end_bytes(self) -> int:
        return self.base_bytes + self.num_positions * self.stride_bytes

    def offsets(self, positions: torch.Tensor) -> torch.Tensor:
        """Byte offset of each position (int64, same shape)."""
        return self.base_bytes + positions.to(torch.int64) * self.stride_bytes


def band_geometry(sizes: PoolSizes) -> tuple[BandGeometry | None, BandGeometry | None]:
    """(low, high) band geometry of the arena `sizes` describes. Pure."""
    spec = sizes.spec
    if spec.mamba is not None and spec.sliding_attention is not None:
        raise ValueError(
            f"{spec.architectures or spec.model_type} has both Mamba and sliding-window layers; the arena "
            "holds two bands (state or sliding-window pages below, full-attention pages above), not three"
        )
    usable = sizes.arena_bytes
    if usable % ALIGN_BYTES:
        raise ValueError(f"the arena's {usable} bytes are not a multiple of {ALIGN_BYTES}")
    low_name, low_stride, low_count = None, 0, 0
    if spec.mamba is not None:
        low_name, low_stride, low_count = "slots", sizes.slot_stride_bytes, sizes.num_slots
    elif spec.sliding_attention is not None:
        low_name, low_stride, low_count = "swa_pages", sizes.swa_page_stride_bytes, sizes.num_swa_pages
    page_stride = sizes.page_stride_bytes if spec.full_attention is not None else 0
    if sizes.unified:  # both bands may reach across the whole usable region
        low_count = usable // low_stride if low_stride else 0
        page_count = usable // page_stride if page_stride else 0
    else:
        page_count = sizes.num_pages if page_stride else 0
    low = BandGeometry(low_name, 0, low_stride, low_count) if low_name else None
    high = None
    if page_stride:
        high = BandGeometry("pages", usable - page_count * page_stride, page_stride, page_count)
    if not sizes.unified and low is not None and high is not None and low.end_bytes > high.base_bytes:
        raise ValueError(
            f"static plan overlaps its bands: low ends at {low.end_bytes}, high at {high.base_bytes}"
        )
    return low, high


def _find(
    places: list[TensorPlace], layer: int, name: str, what: str, layers: tuple[int, ...]
) -> TensorPlace:
    for place in places:
        if place.layer == layer and place.name == name:
            return place
    raise NotALayerOfKind(layer, what, layers)


class Arena:
    """Every byte a pool owns, on one device, with strided per-layer views (no copies)."""

    def __init__(self, sizes: PoolSizes, device: torch.device | str = "cpu") -> None:
        self.sizes = sizes
        self.low, self.high = band_geometry(sizes)
        # Zeroed, not empty: a fresh envelope reads as zeros on every device, which tests rely on.
        self.buffer = torch.zeros(sizes.arena_bytes, dtype=torch.uint8, device=device)
        self._staging_buffer: torch.Tensor | None = None  # allocated by the first sliding copy
        spec = sizes.spec
        self._page_places = page_places(spec.full_attention_layers, spec.full_attention, sizes.page_size)
        self._swa_places = page_places(spec.sliding_window_layers, spec.sliding_attention, sizes.page_size)
        self._slot_places = slot_places(spec)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def _typed(
        self, band: BandGeometry, place: TensorPlace, dtype_name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """(band.num_positions, *shape) in `dtype_name`: dim 0 steps one unit, the rest contiguous
        but for the tensor's first axis where the place says its rows lie `row_stride` apart."""
        dtype = torch_dtype(dtype_name)
        item = dtype.itemsize
        row_stride = place.row_stride or 0
        if band.stride_bytes % item or (band.base_bytes + place.offset) % item or row_stride % item:
            raise ValueError(
                f"a {dtype_name} tensor at byte {band.base_bytes + place.offset}, stride "
                f"{band.stride_bytes}, is not aligned to its {item}-byte elements"
            )
        inner, stride = [], 1
        for dim in reversed(shape):  # contiguous strides of one unit's tensor
            inner.insert(0, stride)
            stride *= dim
        if place.row_stride is not None and inner:
            inner[0] = place.row_stride // item
        return self.buffer.view(dtype).as_strided(
            size=(band.num_positions, *shape),
            stride=(band.stride_bytes // item, *inner),
            storage_offset=(band.base_bytes + place.offset) // item,
        )

    def _kv(
        self,
        band: BandGeometry | None,
        places: list[TensorPlace],
        attn: AttentionSpec | None,
        layers: tuple[int, ...],
        layer: int,
        what: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if band is None or attn is None:
            raise NotALayerOfKind(layer, what, ())
        k = _find(places, layer, "k", what, layers)
        v = _find(places, layer, "v", what, layers)
        ps = self.sizes.page_size
        heads = attn.num_kv_heads
        k_page = self._typed(band, k, attn.dtype, kv_page_shape((heads, attn.head_dim), ps))
        v_page = self._typed(band, v, attn.dtype, kv_page_shape((heads, attn.v_head_dim), ps))
        # Stored (kv_heads, page_size, dim) per page (`KV_ORDER`); read as (page_size, kv_heads, dim).
        return k_page.transpose(1, 2), v_page.transpose(1, 2)

    def kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of full-attention layer `layer`: each (num_page_positions, page_size, kv_heads, dim)."""
        spec = self.sizes.spec
        return self._kv(
            self.high,
            self._page_places,
            spec.full_attention,
            spec.full_attention_layers,
            layer,
            "full-attention",
        )

    def swa_kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of sliding-window layer `layer`: each (num_swa_positions, page_size, kv_heads, dim)."""
        spec = self.sizes.spec
        band = self.low if self.low is not None and self.low.name == "swa_pages" else None
        return self._kv(
            band,
            self._swa_places,
            spec.sliding_attention,
            spec.sliding_window_layers,
            layer,
            "sliding-window",
        )

    def state_view(self, layer: int) -> tuple[torch.Tensor, ...]:
        """One (num_slot_positions, *shape) tensor per `MambaSpec.tensors` entry of Mamba layer `layer`."""
        spec = self.sizes.spec
        if spec.mamba is None or self.low is None:
            raise NotALayerOfKind(layer, "Mamba", ())
        return tuple(
            self._typed(
                self.low,
                _find(self._slot_places, layer, t.name, "Mamba", spec.mamba_layers),
                t.dtype,
                t.shape,
            )
            for t in spec.mamba.tensors
        )

    def byte_ranges(
        self, slot: int | None, page_ids: torch.Tensor, swa_page_ids: torch.Tensor
    ) -> torch.Tensor:
        """(n, 2) int64 [offset, nbytes] of an envelope in canonical order: the slot, each full page,
        then each window page. nbytes is the unit's stride (padding included)."""
        parts = [torch.empty((0, 2), dtype=torch.int64)]
        low, high = self.low, self.high
        if slot is not None and low is not None:
            parts.append(torch.tensor([[low.base_bytes + slot * low.stride_bytes, low.stride_bytes]]))
        for geometry, ids in ((high, page_ids), (low, swa_page_ids)):
            if geometry is not None and ids.numel():
                nbytes = torch.full_like(ids, geometry.stride_bytes)
                parts.append(torch.stack([geometry.offsets(ids), nbytes], dim=1))
        return torch.cat(parts)

    def copy_runs(self, runs_bytes: np.ndarray) -> None:
        """Execute moves, in row order, of (r, 3) int64 [src_offset, dst_offset, nbytes].

        The caller orders the rows so that no row overwrites bytes a later row still reads
        (compaction: see `Frontier.compaction_moves`). A row whose destination overlaps its own
        source (a slide by less than its length) is copied from its far end in pieces: pieces no
        longer than the shift copy directly, others go through a staging buffer.
        """
        for src, dst, nbytes in runs_bytes.tolist():
            shift = abs(dst - src)
            if shift >= nbytes:
                self.buffer[dst : dst + nbytes].copy_(self.buffer[src : src + nbytes])
                continue
            piece = shift if shift >= SLIDE_STAGING_BYTES else min(nbytes, SLIDE_STAGING_BYTES)
            starts = range(0, nbytes, piece)
            for at in reversed(starts) if dst > src else starts:
                n = min(piece, nbytes - at)
                source = self.buffer[src + at : src + at + n]
                if n > shift:
                    source = self._staging(n).copy_(source)
                self.buffer[dst + at : dst + at + n].copy_(source)

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._staging_buffer is None or self._staging_buffer.numel() < nbytes:
            self._staging_buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.buffer.device)
        return self._staging_buffer[:nbytes]
