"""Pool sizing and byte layout: pure functions from a model and a budget to sizes and places.

`sizing.py`: (ModelSpec, PoolArgs, budget) -> frozen PoolSizes; `errors.py`: its refusals as typed
facts (`PoolArgInvalid`, `UnifiedMemoryRefused`, `BudgetTooSmall`); `layout.py`: the
byte layout of one page envelope and one slot envelope (alignment, strides, places); `fingerprint.py`:
the layout fingerprint two pools must share; `tp_sizes.py`: one TP rank's sizes; `tp_layout.py`: what
one end of a channel tells the other about its TP group. Nothing here allocates (and nothing here
words sizes for a reader: `distpool check` does, in `distpool.cli.describe_sizes`).
"""

from distpool.memory.sizing.errors import (
    DEEPSEEK_V4_POOLS,
    NOT_HYBRID,
    SWA_UNDER_PD,
    BudgetTooSmall,
    PoolArgInvalid,
    RequestNeeds,
    UnifiedMemoryRefused,
)
from distpool.memory.sizing.fingerprint import layout_description, layout_fingerprint
from distpool.memory.sizing.layout import (
    ALIGN_BYTES,
    KV_ORDER,
    SLOT_ORDER,
    TensorPlace,
    align_up,
    ceil_div,
    kv_page_shape,
    page_places,
    slot_places,
    slot_stride_bytes,
)
from distpool.memory.sizing.sizing import GIB, PoolArgs, PoolSizes, size_pools
from distpool.memory.sizing.tp_layout import TpEnd
from distpool.memory.sizing.tp_sizes import TpSizes, size_tp_pools

__all__ = [
    "ALIGN_BYTES",
    "BudgetTooSmall",
    "DEEPSEEK_V4_POOLS",
    "GIB",
    "KV_ORDER",
    "NOT_HYBRID",
    "PoolArgInvalid",
    "PoolArgs",
    "PoolSizes",
    "RequestNeeds",
    "SLOT_ORDER",
    "SWA_UNDER_PD",
    "TensorPlace",
    "TpEnd",
    "TpSizes",
    "UnifiedMemoryRefused",
    "align_up",
    "ceil_div",
    "kv_page_shape",
    "layout_description",
    "layout_fingerprint",
    "page_places",
    "size_pools",
    "size_tp_pools",
    "slot_places",
    "slot_stride_bytes",
]
