"""The cache a pooled forward hands to transformers: its conv and recurrent states are our slot's bytes.

A Mamba layer's state tensors sit side by side in a slot (`memory/layout.py`), so each layer's state is
one byte segment per slot. A forward of one request works on views of its slot, which transformers
updates in place (`copy_`); a decode step of several requests gathers each layer's segments of every
request at once (one indexed read per layer, into a `[B, ...]` tensor transformers updates) and
scatters them back after the step (one indexed write per layer). `StateCopies` counts both.

K/V never pass through the cache: its attention layers hand the new tokens' K/V to the registered
attention function (`paged_attention.py`), which keeps them in pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distpool.facts import Facts
from distpool.memory.pool import Pool
from distpool.model.spec import ModelSpec
from distpool.model_impl.hf.transformers_internals import (
    Cache,
    DummyLayer,
    States,
    layer_states,
    paged_layer,
    state_layer,
)

# A segment is rounded up to this many bytes, so typed views over a gathered batch stay aligned: it
# never reaches past the next tensor, which starts at least this aligned (memory/layout.py).
_ALIGN = 64


@dataclass
class StateCopies:
    """State moved between slots and batched tensors so far (a batch of one moves nothing)."""

    gathers: int = 0  # indexed reads: one per Mamba layer per batched step
    scatters: int = 0
    bytes: int = 0  # read plus written
    checkpoint_copies: int = 0  # slot-to-slot copies: a checkpoint read, a snapshot taken


class SlotStates:
    """Each Mamba layer's state as one byte segment per slot: views, gathers, scatters, copies."""

    def __init__(self, pool: Pool, spec: ModelSpec, copies: StateCopies) -> None:
        self.copies = copies
        self.kernel = spec.needs_mamba().tensors[0].shape[-1]  # conv columns: transformers' conv_kernel_size
        self.segments: dict[int, torch.Tensor] = {}  # layer -> (num_slots, segment bytes) uint8
        self.parts: dict[int, list[tuple[int, int, torch.dtype, torch.Size]]] = {}  # offset, bytes, ...
        base = pool.buffer.data_ptr()
        for layer in spec.mamba_layers:
            views = pool.state_view(layer)  # (num_slots, *shape) each, one slot apart
            stride = views[0].stride(0) * views[0].element_size()
            if any(v.stride(0) * v.element_size() != stride for v in views):
                raise ValueError(f"layer {layer}'s state tensors are not one slot apart ({stride} bytes)")
            starts = [v.data_ptr() - base for v in views]
            first = min(starts)
            end = max(s + v[0].numel() * v.element_size() for s, v in zip(starts, views, strict=True))
            length = min(-(-(end - first) // _ALIGN) * _ALIGN, stride)
            self.segments[layer] = pool.buffer.as_strided(
                (views[0].shape[0], length), (stride, 1), pool.buffer.storage_offset() + first
            )
            self.parts[layer] = [
                (s - first, v[0].numel() * v.element_size(), v.dtype, v.shape[1:])
                for s, v in zip(starts, views, strict=True)
            ]

    def _carve(self, layer: int, segment: torch.Tensor) -> States:
        """Typed `(B, *shape)` tensors over a `(B, segment bytes)` uint8 tensor (views, no copy)."""
        out = [
            segment[:, offset : offset + nbytes].view(dtype).view(segment.shape[0], *shape)
            for offset, nbytes, dtype, shape in self.parts[layer]
        ]
        return out[0], out[1]

    def views(self, slot: int) -> dict[int, States]:
        """Per layer, `(1, *shape)` views of one slot's state: transformers updates them in place."""
        return {layer: self._carve(layer, seg[slot : slot + 1]) for layer, seg in self.segments.items()}

    def gather(self, slots: torch.Tensor) -> dict[int, tuple[torch.Tensor, States]]:
        """Per layer, the segments of `slots` copied into one batch tensor, and its typed views."""
        out = {}
        for layer, seg in self.segments.items():
            # (B, segment bytes): one indexed read (index_select: on a CPU several times faster than
            # indexing with the tensor of slots)
            batch = seg.index_select(0, slots.to(seg.device))
            self.copies.gathers += 1
            self.copies.bytes += batch.numel()
            out[layer] = (batch, self._carve(layer, batch))
        return out

    def scatter(self, slots: torch.Tensor, gathered: dict[int, tuple[torch.Tensor, States]]) -> None:
        """Write gathered segments (updated by a forward) back to their slots."""
        for layer, (batch, _) in gathered.items():
            self.segments[layer][slots.to(batch.device)] = batch  # one indexed write
            self.copies.scatters += 1
            self.copies.bytes += batch.numel()

    def copy(self, src_slot: int, dst_slot: int) -> None:
        """Every layer's state of `src_slot` into `dst_slot` (a checkpoint read, a snapshot taken)."""
        for seg in self.segments.values():
            seg[dst_slot].copy_(seg[src_slot])
        self.copies.checkpoint_copies += 1


def pooled_cache(spec: ModelSpec, states: dict[int, States], *, kernel: int, num_past: int) -> Cache:
    """A transformers `Cache` over our memory for one forward: `states` per Mamba layer (views or
    gathered tensors), continuing from earlier tokens when `num_past` > 0."""
    layers: list = []
    for index in range(spec.num_layers):
        mamba = states[index] if index in spec.mamba_layers else None
        if index in spec.full_attention_layers:
            layers.append(paged_layer(num_past, mamba, kernel=kernel))
        elif mamba is not None:
            layers.append(state_layer(mamba, kernel=kernel, continuing=num_past > 0))
        else:
            layers.append(DummyLayer())
    return Cache(layers=layers)


class StatesReplaced(Facts, RuntimeError):
    """transformers replaced layer `layer`'s state tensors rather than updating the pool's in place."""

    def __init__(self, layer: int) -> None:
        super().__init__(
            f"layer {layer}: transformers replaced the pool's state tensors instead of updating them"
        )
        self.layer = layer


def check_states_kept(cache: Cache, states: dict[int, States]) -> None:
    """After a forward: transformers updated our tensors in place rather than replacing them."""
    for index, (conv, recurrent) in states.items():
        kept_conv, kept_recurrent = layer_states(cache, index)
        if kept_conv is not conv or kept_recurrent is not recurrent:
            raise StatesReplaced(index)
