"""Byte layout of one page envelope and one slot envelope (the only code that decides offsets).

Page envelope, `page_size` tokens of every full-attention layer, page-major:

    | L0.K | L0.V | L1.K | L1.V | ... |      each (page_size, kv_heads, head_dim) in the KV dtype

Slot envelope, one request's recurrent state of every Mamba layer:

    | L0.conv | L0.ssm | L1.conv | L1.ssm | ... |   each tensor in its own dtype, ALIGN_BYTES-aligned

Both strides are rounded up to ALIGN_BYTES so every view starts on an aligned address.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distpool.spec import AttentionSpec, ModelSpec, dtype_bytes

if TYPE_CHECKING:
    from distpool.configurator import PoolPlan

# 64 bytes: a cache line on CPUs and a multiple of every dtype's size, so views never straddle.
ALIGN_BYTES = 64


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


def page_places(layers: tuple[int, ...], attn: AttentionSpec | None, page_size: int) -> list[TensorPlace]:
    """K then V of each layer in `layers`, for one page of `page_size` tokens."""
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
    """Every Mamba layer's state tensors, in slot order, each start aligned."""
    if spec.mamba is None:
        return []
    places, offset = [], 0
    for layer in spec.mamba_layers:
        for tensor in spec.mamba.tensors:
            places.append(TensorPlace(layer=layer, name=tensor.name, offset=offset, nbytes=tensor.nbytes))
            offset = align_up(offset + tensor.nbytes)
    return places


def slot_stride_bytes(spec: ModelSpec) -> int:
    places = slot_places(spec)
    return align_up(places[-1].offset + places[-1].nbytes) if places else 0


def layout_description(plan: PoolPlan) -> dict[str, object]:
    """Every field that decides where a byte of an envelope lives. Prefill and decode must agree."""
    return {
        **json.loads(json.dumps(plan.spec.layout_fields(), default=str)),  # plain JSON values
        "page_size": plan.page_size,
        "unified": plan.unified,
        "page_stride_bytes": plan.page_stride_bytes,
        "swa_page_stride_bytes": plan.swa_page_stride_bytes,
        "slot_stride_bytes": plan.slot_stride_bytes,
        "align_bytes": ALIGN_BYTES,
    }


def layout_fingerprint(plan: PoolPlan) -> str:
    blob = json.dumps(layout_description(plan), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def differing_fields(mine: dict[str, object], theirs: dict[str, object]) -> list[str]:
    """Names of the layout fields on which two descriptions disagree (for handshake errors)."""
    return sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
