"""The cache a pooled forward hands to transformers: its conv and recurrent states are our slot's bytes.

A slot keeps each state tensor's rows of every Mamba layer interleaved (`memory/sizing/layout.py`),
so a layer's state is strided views over the pool (`Pool.state_view`). A forward of one request
works on views of its slot, which transformers updates in place (`copy_`); a decode step of several
requests gathers each layer's state of every request at once (an indexed read of each tensor, into
the `[B, ...]` tensors transformers updates) and scatters it back after the step (an indexed write
of each). `StateCopies` counts both, per layer.

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


@dataclass
class StateCopies:
    """State moved between slots and batched tensors so far (a batch of one moves nothing)."""

    gathers: int = 0  # indexed reads: one per Mamba layer per batched step
    scatters: int = 0
    bytes: int = 0  # read plus written
    checkpoint_copies: int = 0  # slot-to-slot copies: a checkpoint read, a snapshot taken


class SlotStates:
    """Each Mamba layer's state tensors as the pool's views over every slot: views, gathers,
    scatters, copies."""

    def __init__(self, pool: Pool, spec: ModelSpec, copies: StateCopies) -> None:
        self.copies = copies
        self.kernel = spec.needs_mamba().tensors[0].shape[-1]  # conv columns: transformers' conv_kernel_size
        self.tensors: dict[int, States] = {}  # layer -> (conv, recurrent), (num_slots, *shape) each
        for layer in spec.mamba_layers:
            conv, recurrent = pool.state_view(layer)
            self.tensors[layer] = conv, recurrent

    @property
    def num_slots(self) -> int:
        return next(iter(self.tensors.values()))[0].shape[0]

    def views(self, slot: int) -> dict[int, States]:
        """Per layer, `(1, *shape)` views of one slot's state: transformers updates them in place."""
        return {
            layer: (conv[slot : slot + 1], recurrent[slot : slot + 1])
            for layer, (conv, recurrent) in self.tensors.items()
        }

    def gather(self, slots: torch.Tensor) -> dict[int, States]:
        """Per layer, the states of `slots` copied into `[B, ...]` tensors (one gather of a layer's
        state: an indexed read of each tensor; index_select, on a CPU several times faster than
        indexing with the tensor of slots)."""
        out = {}
        for layer, (conv, recurrent) in self.tensors.items():
            index = slots.to(conv.device)
            batch = conv.index_select(0, index), recurrent.index_select(0, index)
            self.copies.gathers += 1
            self.copies.bytes += sum(t.numel() * t.element_size() for t in batch)
            out[layer] = batch
        return out

    def scatter(self, slots: torch.Tensor, gathered: dict[int, States]) -> None:
        """Write gathered states (updated by a forward) back to their slots."""
        for layer, batch in gathered.items():
            for view, updated in zip(self.tensors[layer], batch, strict=True):
                view[slots.to(updated.device)] = updated  # one indexed write per tensor
            self.copies.scatters += 1
            self.copies.bytes += sum(t.numel() * t.element_size() for t in batch)

    def copy(self, src_slot: int, dst_slot: int) -> None:
        """Every layer's state of `src_slot` into `dst_slot` (a checkpoint read, a snapshot taken)."""
        for states in self.tensors.values():
            for view in states:
                view[dst_slot].copy_(view[src_slot])
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
