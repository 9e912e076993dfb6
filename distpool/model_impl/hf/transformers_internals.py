"""Everything distpool uses of transformers beyond its documented API, checked against 5.23 and 5.24.

The rest of `model_impl` reaches transformers' internals only through this module:
- the cache layers of `transformers.cache_utils`: a recurrent layer's per-state dicts (`conv_states[0]`,
  `recurrent_states[0]`, `is_conv_states_initialized`, `is_recurrent_states_initialized`,
  `has_previous_state`, `conv_kernel_size`) and its `device` and `dtype`, an attention layer's
  `keys`, and subclasses of `DynamicLayer` and `LinearAttentionAndFullAttentionLayer` whose
  `update` hands the new K/V on untouched (`paged_layer`, `state_layer`, `layer_states`);
- the name a model's forward takes its cache by, told by its signature: `cache` from 5.24 on,
  `past_key_values` in 5.23 (`cache_argument`);
- `transformers.core_model_loading.revert_weight_conversion` and a model's `all_tied_weights_keys`:
  the names `save_pretrained` writes (`weight_forms`);
- `transformers.integrations.sdpa_attention.sdpa_attention_forward`, its SDPA attention function.
The modeling code's module attributes `layout.py` reads (head counts, state sizes, `layer_idx`) are
not here: `layout.check_allocation` holds them against what transformers allocates at every load.

Importing this module checks the installed transformers first: a version outside the checked ones
raises `TransformersVersionError` naming it and the range, before any of the names above is looked
up (a missing one would otherwise fail as an ImportError, or deep inside a forward).
"""

from __future__ import annotations

import inspect
import re

import torch
import transformers
from torch import nn

from distpool.facts import Facts

# The releases (major, minor) the uses above were checked against; pyproject.toml declares exactly
# these (tests/model_impl/test_transformers_internals.py holds the two together).
CHECKED_RELEASES: tuple[tuple[int, int], ...] = ((5, 23), (5, 24))
DECLARED_RANGE = ">=5.23,<5.25"


class TransformersVersionError(Facts, ValueError):
    """The installed transformers is not one the internals this module uses were checked against."""

    def __init__(self, installed: str) -> None:
        checked = " and ".join(f"{major}.{minor}" for major, minor in CHECKED_RELEASES)
        super().__init__(
            f"transformers {installed} is installed; the transformers runner uses its internals as "
            f"transformers {checked} have them (transformers{DECLARED_RANGE}, as pyproject.toml declares)"
        )
        self.installed = installed
        self.checked = CHECKED_RELEASES
        self.declared = DECLARED_RANGE


def release_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ("5.24.0" -> (5, 24)); None when it does not start so."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def check_version(installed: str) -> None:
    """TransformersVersionError unless `installed` is a release of the checked ones."""
    if release_of(installed) not in CHECKED_RELEASES:
        raise TransformersVersionError(installed)


check_version(transformers.__version__)  # before the names below are looked up

from transformers.cache_utils import (  # noqa: E402
    Cache,
    DummyLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)
from transformers.core_model_loading import revert_weight_conversion  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

__all__ = [
    "CHECKED_RELEASES",
    "DECLARED_RANGE",
    "Cache",
    "DummyLayer",
    "States",
    "TransformersVersionError",
    "cache_argument",
    "check_version",
    "layer_keys",
    "layer_states",
    "paged_layer",
    "release_of",
    "sdpa_attention_forward",
    "state_layer",
    "weight_forms",
]

States = tuple[torch.Tensor, torch.Tensor]  # (conv, recurrent), each (B, *shape)


class PagedKVLayer(DynamicLayer):
    """An attention layer whose K/V live in pool pages: `update` passes the new tokens' K/V on to
    the registered attention function, which writes and reads the pages."""

    def __init__(self, num_past: int) -> None:
        super().__init__()
        self.is_initialized = True
        self.num_past = num_past  # tokens before this forward (the longest request's)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.num_past


class PagedHybridLayer(LinearAttentionAndFullAttentionLayer):
    """Attention beside a recurrent mixer in one layer (Falcon-H1): paged K/V, slot state."""

    def __init__(self, num_past: int) -> None:
        super().__init__()
        self.is_initialized = True
        self.num_past = num_past

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.num_past


def paged_layer(num_past: int, states: States | None, *, kernel: int) -> DynamicLayer:
    """An attention layer over pool pages, `num_past` tokens in; with `states` (a recurrent mixer
    beside it), those as its conv and recurrent state (`state_layer`)."""
    if states is None:
        return PagedKVLayer(num_past)
    layer = PagedHybridLayer(num_past)
    _attach(layer, states, kernel, continuing=num_past > 0)
    return layer


def state_layer(states: States, *, kernel: int, continuing: bool) -> LinearAttentionLayer:
    """A recurrent layer whose conv and recurrent state are `states` (transformers updates them in
    place); `continuing`: they hold earlier tokens' state, else transformers starts them afresh."""
    layer = LinearAttentionLayer()
    _attach(layer, states, kernel, continuing)
    return layer


def _attach(layer: LinearAttentionLayer, states: States, kernel: int, continuing: bool) -> None:
    conv, recurrent = states
    layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.conv_kernel_size[0] = kernel  # conv columns kept
    layer.has_previous_state[0] = continuing
    layer.device, layer.dtype = conv.device, conv.dtype


def layer_states(cache: Cache, index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(conv, recurrent) state of `cache`'s recurrent layer `index` as the layer holds them now."""
    layer = cache.layers[index]
    return layer.conv_states[0], layer.recurrent_states[0]


def layer_keys(cache: Cache, index: int) -> torch.Tensor:
    """The keys `cache`'s attention layer `index` holds, (B, kv_heads, tokens, head_dim)."""
    return cache.layers[index].keys


def cache_argument(model: nn.Module) -> str:
    """The name the model's forward takes its cache by: `cache` from transformers 5.24 on,
    `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def weight_forms(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The names and shapes a checkpoint of `model` may store its weights under: those
    `save_pretrained` writes (transformers' load-time conversions, fused MoE experts and renamings,
    reversed), and the modules' own. Tied weights (stored once, under the other's name) are left out.
    On the meta device it reads no memory."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    own = model.state_dict()

    def shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in state.items() if name not in tied}

    return shapes(revert_weight_conversion(model, own)), shapes(own)
