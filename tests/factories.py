"""Small factories for pool tests: hand-built ModelSpecs, plans and pools (no Hugging Face configs).

The default hybrid-Mamba spec is small enough to reason about byte by byte:
- layers 0 and 2 are Mamba, 1 and 3 full attention; KV is 2 heads x 8 dims in bfloat16, so one token
  of one layer is 64 bytes of K+V and a 4-token page over both layers is 512 bytes;
- each Mamba layer has conv (3, 16) bfloat16 (96 bytes, padded to 128) and ssm (2, 4, 8) float32
  (256 bytes), so a slot is 768 bytes: 1.5 pages, which keeps the two bands' strides unaligned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from distpool.memory.arena_pool import ArenaPool, build_pool
from distpool.memory.prefix import CacheNews, StateKey, chained_block_keys
from distpool.memory.sizing import PoolArgs, PoolSizes, size_pools
from distpool.model.hf_config import spec_from_hf
from distpool.model.shard import RankShard
from distpool.model.spec import (
    DENSE,
    HYBRID_MAMBA,
    HYBRID_SWA,
    AttentionSpec,
    MambaSpec,
    ModelSpec,
    StateTensorSpec,
)
from distpool.model_impl.pool_model import PoolModel
from distpool.model_impl.prefill_job import PrefillJob
from distpool.worker.stats import DecodeStats

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


def prefill_tokens(model: PoolModel, pool, prompts: dict[str, Sequence[int]]) -> list[int]:
    """Prefill each request (reserved with its prompt's length) from nothing, as one batch: the
    first tokens, in order."""
    jobs = [PrefillJob(request_id, prompt) for request_id, prompt in prompts.items()]
    return [done.first_token for done in model.prefill(pool, jobs)]


def free_units(pool: ArenaPool) -> dict[str, int]:
    """Positions nobody owns, per band; a fresh pool's figure once every request is released."""
    return {name: usage.free for name, usage in pool.usage().items()}


def accounting(pool: ArenaPool) -> tuple:
    """Everything a refused call must leave unchanged: usage, and what is available now and after
    a compaction."""
    return pool.usage(), pool.available(), pool.available(after_compaction=True)


# ---- tensor parallelism -------------------------------------------------------------------------
# Small Hugging Face configs whose shard rules differ, read through `spec_from_hf` like real ones.
_NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 64,
    "hybrid_override_pattern": "M*M-M*",  # Mamba2 layers 0, 2, 4; attention 1, 5
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "mamba_num_heads": 8,
    "mamba_head_dim": 4,
    "ssm_state_size": 8,
    "conv_kernel": 4,
    "torch_dtype": "bfloat16",
    "vocab_size": 1000,
}
TP_CONFIGS: dict[str, dict] = {
    # Mamba2, one group: B and C replicated on every rank at TP 2 and 4
    "mamba2_groups1": _NEMOTRON_H | {"n_groups": 1, "num_key_value_heads": 2},
    # Mamba2, eight groups: B and C split like the heads
    "mamba2_groups8": _NEMOTRON_H | {"n_groups": 8},
    # gated delta net (Qwen3-Next): 2 KV heads, fewer than TP 4; conv q | k | v by key and value heads
    "gdn_kv2": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,  # layers 1 and 3 are full attention
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 4,
        "linear_value_head_dim": 4,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
        "vocab_size": 1000,
    },
    # Falcon-H1: attention and Mamba2 side by side in every layer; one group. A head dim of 3 puts a
    # TP-4 rank's piece of x at byte offsets that are not whole words (the pattern's byte path)
    "falcon_h1": {
        "architectures": ["FalconH1ForCausalLM"],
        "model_type": "falcon_h1",
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "mamba_d_ssm": 24,
        "mamba_n_heads": 8,
        "mamba_d_head": 3,
        "mamba_n_groups": 1,
        "mamba_d_state": 6,
        "mamba_d_conv": 4,
        "torch_dtype": "bfloat16",
        "vocab_size": 1000,
    },
    # sliding-window and full-attention layers (Gemma 3): window pages shard like pages
    "gemma3_swa": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "sliding_window_pattern": 2,  # layers 1 and 3 are global, 0 and 2 slide over 8 tokens
        "sliding_window": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "torch_dtype": "bfloat16",
        "vocab_size": 1000,
    },
    # Kimi-Linear: MLA (one latent per token, replicated on every rank) and KDA (q, k, v convs by heads)
    "kimi_mla": {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "linear_attn_config": {
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
            "head_dim": 4,
            "num_heads": 8,
            "short_conv_kernel_size": 4,
        },
        "torch_dtype": "bfloat16",
        "vocab_size": 1000,
    },
}


def tp_spec(name: str) -> ModelSpec:
    """The spec of `TP_CONFIGS[name]`, classified as a real config is."""
    return spec_from_hf(TP_CONFIGS[name])


def make_rank_pool(
    shard: RankShard, *, unified: bool, budget_bytes: int = 64 << 10, prefix_cache: bool = False
) -> ArenaPool:
    """One TP rank's pool: sized for the shapes the rank stores (`shard.spec`)."""
    sizes = make_sizes(shard.spec, unified=unified, budget_bytes=budget_bytes, context_len=32)
    return ArenaPool(sizes, "cpu", prefix_cache=prefix_cache)


def make_decode_stats(name: str = "decode-0", **figures: int) -> DecodeStats:
    """A decode worker's stats after a drained run (every count 0, 8 pages and 2 slots), with
    `figures` changed."""
    zero = {f.name: 0 for f in dataclasses.fields(DecodeStats)}
    base = zero | {"name": name, "role": "decode", "node_id": None, "pages_capacity": 8, "slots_capacity": 2}
    return DecodeStats(**(base | figures))


def finished_news(tokens: Sequence[int], page_size: int, *, state: bool = True, dropped=()) -> CacheNews:
    """What a decode worker reports once a request holding KV for `tokens` finished: it cached their
    full pages and (`state`) kept the state after them; `dropped`: token sequences whose kept states
    went (an earlier turn it supersedes)."""
    return CacheNews(
        cached_pages=tuple(chained_block_keys(tokens, page_size)),
        kept_states=(StateKey.of(tokens, page_size),) if state else (),
        dropped_states=tuple(StateKey.of(d, page_size) for d in dropped),
    )
