"""Small factories for pool tests: hand-built ModelSpecs, plans and pools (no Hugging Face configs).

The default hybrid-Mamba spec is small enough to reason about byte by byte:
- layers 0 and 2 are Mamba, 1 and 3 full attention; KV is 2 heads x 8 dims in bfloat16, so one token
  of one layer is 64 bytes of K+V and a 4-token page over both layers is 512 bytes;
- each Mamba layer has conv (3, 16) bfloat16 (96 bytes, padded to 128) and ssm (2, 4, 8) float32
  (256 bytes), so a slot is 768 bytes: 1.5 pages, which keeps the two bands' strides unaligned.
"""

from __future__ import annotations

from pathlib import Path

from distpool.memory.arena_pool import ArenaPool, build_pool
from distpool.memory.sizing import PoolArgs, PoolSizes, size_pools
from distpool.model.spec import (
    DENSE,
    HYBRID_MAMBA,
    HYBRID_SWA,
    AttentionSpec,
    MambaSpec,
    ModelSpec,
    StateTensorSpec,
)

PAGE_SIZE = 4
CONTEXT_LEN = 16
FIXTURES = Path(__file__).resolve().parent / "fixtures"  # public config.json files, trimmed


def make_spec(
    kind: str = HYBRID_MAMBA,
    *,
    num_layers: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    kv_dtype: str = "bfloat16",
    sliding_window: int = 8,
    conv_shape: tuple[int, ...] = (3, 16),
    ssm_shape: tuple[int, ...] = (2, 4, 8),
    conv_dtype: str = "bfloat16",
    ssm_dtype: str = "float32",
    attention_free: bool = False,
) -> ModelSpec:
    """Even layers are the second kind (Mamba or sliding window), odd layers full attention.
    `dense`: every layer full attention, or every layer Mamba with `attention_free=True`."""
    layers = tuple(range(num_layers))
    even, odd = layers[::2], layers[1::2]
    full = swa = mamba = ()
    if kind == HYBRID_MAMBA:
        mamba, full = even, odd
    elif kind == HYBRID_SWA:
        swa, full = even, odd
    elif kind == DENSE:
        mamba, full = (layers, ()) if attention_free else ((), layers)
    else:
        raise ValueError(f"make_spec builds hybrid_mamba, hybrid_swa or dense specs; got {kind!r}")
    attention = AttentionSpec(num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim, dtype=kv_dtype)
    state = MambaSpec(
        family="mamba2",
        tensors=(
            StateTensorSpec(name="conv", shape=conv_shape, dtype=conv_dtype),
            StateTensorSpec(name="ssm", shape=ssm_shape, dtype=ssm_dtype),
        ),
    )
    return ModelSpec(
        kind=kind,
        architectures=(f"Test{kind.title().replace('_', '')}ForCausalLM",),
        model_type=f"test_{kind}",
        num_layers=num_layers,
        full_attention_layers=full,
        sliding_window_layers=swa,
        mamba_layers=mamba,
        full_attention=attention if full else None,
        sliding_attention=AttentionSpec(
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
            dtype=kv_dtype,
            sliding_window=sliding_window,
        )
        if swa
        else None,
        mamba=state if mamba else None,
        dtype="bfloat16",
    )


def make_sizes(
    spec: ModelSpec | None = None,
    *,
    unified: bool = True,
    budget_bytes: int = 7680,
    page_size: int = PAGE_SIZE,
    context_len: int = CONTEXT_LEN,
    **args: object,
) -> PoolSizes:
    """A plan for `spec` (default: `make_spec()`); extra keyword arguments go to PoolArgs."""
    pool_args = PoolArgs(enable_unified_memory=unified, page_size=page_size, context_len=context_len, **args)
    return size_pools(spec or make_spec(), pool_args, budget_bytes)


def make_pool(spec: ModelSpec | None = None, *, device: str = "cpu", **size_args: object) -> ArenaPool:
    """A pool (CPU unless told otherwise) built from `make_sizes(spec, **size_args)`."""
    return build_pool(make_sizes(spec, **size_args), device)


def free_units(pool: ArenaPool) -> dict[str, int]:
    """Positions nobody owns, per band; a fresh pool's figure once every request is released."""
    return {name: usage.free for name, usage in pool.usage().items()}


def accounting(pool: ArenaPool) -> tuple:
    """Everything a refused call must leave unchanged: usage, and what is available now and after
    a compaction."""
    return pool.usage(), pool.available(), pool.available(after_compaction=True)
