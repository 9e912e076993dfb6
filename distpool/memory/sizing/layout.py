"""Byte layout of one page envelope and one slot envelope (the only code that decides offsets).

Page envelope, `page_size` tokens of every full-attention layer, page-major:

    | L0.K | L0.V | L1.K | L1.V | ... |      each (kv_heads, page_size, head_dim) in the KV dtype

Heads outermost inside each tensor (`KV_ORDER`): a TP rank's share of a layer's heads is one run
of a page, not one slice per token, so a transfer between TP sizes moves a few runs of kilobytes
per page rather than one run of a head slice per token and layer. The pool's K/V views still read
(pages, page_size, kv_heads, dim): strided views over this order.

Slot envelope, one request's recurrent state of every Mamba layer, one region per state tensor:

    | conv (rows, layers, ...) | ssm (rows, layers, ...) |   each in its own dtype, ALIGN_BYTES-aligned

Inside a region the tensor's first axis (the one TP splits: heads, conv channels) is outermost and
the layer next (`SLOT_ORDER`): a TP rank's share of a state tensor is one run across every layer
(a few for a conv state's segments), not one per layer. A layer's state is a strided view: its rows
lie `layers x row bytes` apart (`TensorPlace.row_stride`).

Both strides are rounded up to ALIGN_BYTES so every view starts on an aligned address.
"""

from __future__ import annotations

from dataclasses import dataclass

from distpool.model.dtypes import dtype_bytes
from distpool.model.spec import AttentionSpec, ModelSpec, StateTensorSpec

# 64 bytes: a cache line on CPUs and a multiple of every dtype's size, so views never straddle.
ALIGN_BYTES = 64

# The order of K's and V's dims inside a page (the layout fingerprint carries it).
KV_ORDER = ("kv_heads", "page_size", "dim")
# The order of a slot's dims: one region per state tensor, its first axis outermost, then the layer.
SLOT_ORDER = ("tensor", "rows", "layer", "rest")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align_up(nbytes: int, alignment: int = ALIGN_BYTES) -> int:
    return ceil_div(nbytes, alignment) * alignment


@dataclass(frozen=True)
class TensorPlace:
    """Where one per-layer tensor sits inside its envelope."""

    layer: int  # model layer index
    name: str  # "k", "v", or the state tensor's name
    offset: int  # bytes from the envelope's start
    nbytes: int
    # Bytes between successive indices of the tensor's first axis; None: the tensor is contiguous.
    row_stride: int | None = None


def kv_page_shape(row: tuple[int, ...], page_size: int) -> tuple[int, ...]:
    """A token's K or V row, (kv_heads, dim), as one page holds `page_size` of them (`KV_ORDER`)."""
    heads, *rest = row
    return (heads, page_size, *rest)


def page_places(layers: tuple[int, ...], attn: AttentionSpec | None, page_size: int) -> list[TensorPlace]:
    """K then V of each layer in `layers`, for one page of `page_size` tokens (each `kv_page_shape`)."""
    if attn is None:
        return []
    k_bytes = page_size * attn.num_kv_heads * attn.head_dim * dtype_bytes(attn.dtype)
    v_bytes = page_size * attn.num_kv_heads * attn.v_head_dim * dtype_bytes(attn.dtype)
    places, offset = [], 0
    for layer in layers:
        places.append(TensorPlace(layer=layer, name="k", offset=offset, nbytes=k_bytes))
        places.append(TensorPlace(layer=layer, name="v", offset=offset + k_bytes, nbytes=v_bytes))
        offset += k_bytes + v_bytes
    return places


def slot_places(spec: ModelSpec) -> list[TensorPlace]:
    """Every Mamba layer's state tensors (`SLOT_ORDER`), by layer then tensor: each tensor's region
    starts aligned (`slot_stride_bytes`), and a layer's rows of it lie `row_stride` apart."""
    if spec.mamba is None:
        return []
    layers = spec.mamba_layers
    places, region = [], 0
    for tensor in spec.mamba.tensors:
        rows = tensor.shape[0] if tensor.shape else 1
        row_bytes = tensor.nbytes // rows if rows else 0
        for i, layer in enumerate(layers):
            place = TensorPlace(
                layer=layer,
                name=tensor.name,
                offset=region + i * row_bytes,
                nbytes=tensor.nbytes,
                row_stride=len(layers) * row_bytes,
            )
            places.append(place)
        region += _region_bytes(tensor, len(layers))
    return sorted(places, key=lambda p: p.layer)  # stable: each layer's tensors in spec order


def _region_bytes(tensor: StateTensorSpec, num_layers: int) -> int:
    """A state tensor's region in a slot: every layer's tensor rounded up to ALIGN_BYTES (the
    padding at the region's end), so the next region starts aligned and a slot is as large as when
    each layer's tensors lay side by side."""
    return num_layers * align_up(tensor.nbytes)


def slot_stride_bytes(spec: ModelSpec) -> int:
    if spec.mamba is None:
        return 0
    return sum(_region_bytes(t, len(spec.mamba_layers)) for t in spec.mamba.tensors)
