"""Classify a Hugging Face `config.json` into a `ModelSpec`: the only code that knows HF field quirks.

Kinds are decided by structure, not by model name, so architectures not listed here classify too:
- `hybrid_mamba`: at least one attention layer and at least one layer with a recurrent state (Mamba1/2,
  gated DeltaNet, KDA, LFM2 short conv). Parallel hybrids list a layer in both `full_attention_layers`
  and `mamba_layers` (Falcon-H1: every layer; Zamba2: its "hybrid" layers).
- `hybrid_swa`: full-attention layers mixed with sliding-window layers. Llama 4's chunked layers count as
  sliding-window layers with window = `attention_chunk_size`. Gemma 2 and 3 are decided by structure:
  their configs mix sliding and global layers, so they are `hybrid_swa`. A window on every layer
  (Mistral 7B v0.1, Phi-3) is `dense`: one kind of layer, listed as full attention whose
  AttentionSpec keeps the window (a plain KV pool; nothing hybrid to split).
- `deepseek_v4`: DeepSeek-V4. Every layer keeps a `sliding_window` KV branch (all layers are listed as
  sliding-window layers); layers whose compress ratio is above 1 also keep a compressed KV (listed as
  full-attention layers, sized per stored entry: the ratio is not part of `ModelSpec`). Both hold one
  shared K=V entry per token: `AttentionSpec(num_kv_heads=1, head_dim=head_dim, v_head_dim=0)`.
- `dense`: everything else, including models with no attention layer at all (pure Mamba), whose Mamba
  layers are still listed.

Sizes: a full-attention layer caches K and V of `num_key_value_heads x head_dim` per token (head_dim
defaults to hidden_size / num_attention_heads; Gemma 4's global layers use `global_head_dim` and, with
`attention_k_eq_v`, `num_global_key_value_heads`; MiMo's `v_head_dim` and `swa_*` fields are honoured).
MLA models (`kv_lora_rank` set: DeepSeek V2/V3, Kimi-Linear) cache one latent per token:
`AttentionSpec(num_kv_heads=1, head_dim=kv_lora_rank + qk_rope_head_dim, v_head_dim=0)`. The last
`num_kv_shared_layers` layers (Gemma 3n/4) reuse earlier layers' KV and cache nothing. Recurrent state
shapes are in `hf_state`, the layer schedule readers in `hf_schedule`.

Dtypes: KV and conv states are stored in the model dtype (`torch_dtype` or `dtype` of the text config,
then of the top level; bfloat16 when absent or "auto"). The SSM / recurrent state is stored in
`mamba_ssm_cache_dtype` (or `mamba_ssm_dtype`) when the config sets it ("auto": the model dtype), else
in float32. The `kv_dtype`, `conv_dtype` and `ssm_dtype` overrides replace these. Names are canonical
("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"); aliases such as "bf16",
"fp32", "half" or "torch.float16" are accepted.

Multimodal wrappers are read through their nested `text_config` (or `language_config` / `llm_config`).
Anything missing or malformed raises `ConfigInvalid` (a ValueError) naming the file (or "<dict>"), the
field and its value; a file that cannot be read raises `ConfigUnreadable`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distpool.model.dtypes import DTYPE_NAMES, canonical_dtype
from distpool.model.hf_families import FAMILIES
from distpool.model.hf_fields import NUM_LAYERS, ConfigFields, ConfigInvalid, load_config
from distpool.model.hf_schedule import ATTENTION_OF_TAG, RECURRENT_TAGS, SCHEDULE_FIELDS, layer_schedule
from distpool.model.hf_state import recurrent_state
from distpool.model.spec import DEEPSEEK_V4, DENSE, HYBRID_MAMBA, HYBRID_SWA, AttentionSpec, ModelSpec

_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
_OVERRIDES = ("kv_dtype", "conv_dtype", "ssm_dtype")
# Zamba2's shared attention block runs on [hidden, embeddings]: twice hidden_size wide.
_ATTENTION_WIDTH = {"zamba2": 2}
_V4_RATIO_OF_TYPE = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}


def _dtype_override(source: str, name: str, value: object) -> str:
    """The canonical dtype an override `name` spells; ConfigInvalid (field "override NAME") if none."""
    try:
        return canonical_dtype(value)
    except ValueError:
        message = f"override {name}: unknown dtype {value!r}; use {DTYPE_NAMES}"
        raise ConfigInvalid(source, f"override {name}", value, f"one of {DTYPE_NAMES}", message) from None


def spec_from_hf(config: Mapping[str, Any] | str | Path, **overrides: str | None) -> ModelSpec:
    """Classify a Hugging Face config: a dict, a `config.json` path, or a directory holding one.

    `overrides` may set `kv_dtype`, `conv_dtype` and `ssm_dtype` (dtype names, or None: the default).
    Raises ValueError naming the file and the field for anything missing or malformed.
    """
    data, source = load_config(config)
    if unknown := sorted(set(overrides) - set(_OVERRIDES)):
        supported = ", ".join(_OVERRIDES)
        message = f"unknown override(s) {unknown}; supported: {supported}"
        raise ConfigInvalid(source, "overrides", unknown, f"among {supported}", message)
    kv, conv, ssm = (
        None if overrides.get(k) is None else _dtype_override(source, k, overrides[k]) for k in _OVERRIDES
    )
    root = ConfigFields(data, source)
    text = next((root.sub(k) for k in _TEXT_CONFIG_KEYS if root.has(k)), root)
    model_type = text.text("model_type") or root.text("model_type") or ""
    f = ConfigFields(text.data, source, text.prefix, FAMILIES.get(model_type, (None, {}))[1])
    model_dtype = _model_dtype(f, root)
    kv = kv or model_dtype
    common: dict[str, Any] = {
        "architectures": _architectures(root, text),
        "model_type": root.text("model_type") or model_type,  # the checkpoint's, like architectures
        "dtype": model_dtype,
        "hidden_size": f.int("hidden_size", "d_model", default=0),
        "vocab_size": f.int("vocab_size", default=0) or root.int("vocab_size", default=0),
        "num_attention_heads": f.int("num_attention_heads", default=0),
        "intermediate_size": _optional_int(f, "intermediate_size"),
        "norm_eps": _norm_eps(f),
        "source": source,
    }
    if model_type == "deepseek_v4" or f.has("compress_ratios"):
        return _deepseek_v4(f, kv, common)

    tags = _drop_shared_kv(f, layer_schedule(f, model_type) or _uniform_schedule(f, common, model_type))
    full = tuple(i for i, t in enumerate(tags) if ATTENTION_OF_TAG[t] == "full")
    sliding = tuple(i for i, t in enumerate(tags) if ATTENTION_OF_TAG[t] in ("sliding", "chunked"))
    mamba = tuple(i for i, t in enumerate(tags) if t in RECURRENT_TAGS)
    full_window = None
    if sliding and not full and not mamba:
        # A window on every layer (Mistral 7B v0.1) is a plain KV pool: one kind of attention layer,
        # reported as full attention with its window kept on the AttentionSpec.
        full, sliding, full_window = sliding, (), _window(f, tags)
    if mamba and (full or sliding):
        kind = HYBRID_MAMBA
    else:  # uniform attention, or no attention at all (pure Mamba): dense
        kind = HYBRID_SWA if full and sliding else DENSE
    return ModelSpec(
        kind=kind,
        num_layers=len(tags),
        full_attention_layers=full,
        sliding_window_layers=sliding,
        mamba_layers=mamba,
        full_attention=_attention(f, model_type, kv, full_window) if full else None,
        sliding_attention=_attention(f, model_type, kv, _window(f, tags)) if sliding else None,
        mamba=recurrent_state(f, model_type, conv or model_dtype, ssm or _ssm_dtype(f, root, model_dtype))
        if mamba
        else None,
        **common,
    )


def _optional_int(f: ConfigFields, name: str) -> int:
    """A compute dimension the caches do not depend on: 0 unless the config states a positive int
    (some configs give per-layer lists, which no cache size reads)."""
    value = f.data.get(name)
    return value if type(value) is int and value > 0 else 0


def _norm_eps(f: ConfigFields) -> float:
    for name in ("layer_norm_epsilon", "rms_norm_eps", "norm_eps"):
        value = f.data.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1:
            return float(value)
    return 1e-5


def _architectures(root: ConfigFields, text: ConfigFields) -> tuple[str, ...]:
    for f in (root, text):
        if f.has("architectures"):
            names = f.seq("architectures")
            if not all(isinstance(n, str) for n in names):
                raise f.error("architectures", names, "a list of strings")
            return tuple(names)
    return ()


def _dtype(fields: ConfigFields, name: str, value: Any) -> str:
    try:
        return canonical_dtype(value)
    except ValueError:
        message = f"field {fields.name(name)!r}: unknown dtype {value!r}; use {DTYPE_NAMES}"
        raise fields.error(name, value, DTYPE_NAMES, message) from None


def _model_dtype(f: ConfigFields, root: ConfigFields) -> str:
    for fields in (f, root):
        found = fields.find("torch_dtype", "dtype")
        if found is not None and found[1] != "auto":
            return _dtype(fields, *found)
    return "bfloat16"


def _ssm_dtype(f: ConfigFields, root: ConfigFields, model_dtype: str) -> str:
    for fields in (f, root):
        found = fields.find("mamba_ssm_cache_dtype", "mamba_ssm_dtype")
        if found is not None:
            return model_dtype if found[1] == "auto" else _dtype(fields, *found)
    return "float32"


def _uniform_schedule(f: ConfigFields, common: dict[str, Any], model_type: str) -> list[str]:
    """A plain transformer: every layer full attention, or every layer sliding when a window is on."""
    standard = (NUM_LAYERS, ("num_attention_heads",), ("hidden_size", "head_dim"))
    if missing := [f.name(names[0]) for names in standard if f.find(*names) is None]:
        name = ", ".join(common["architectures"]) or model_type or "(no architectures, no model_type)"
        fields = (
            f"one of the hybrid layer fields ({', '.join(SCHEDULE_FIELDS)}) or the standard attention fields"
        )
        message = (
            f"unknown architecture {name}: the config has none of the hybrid layer fields "
            f"({', '.join(SCHEDULE_FIELDS)}) and lacks the standard attention fields {missing}"
        )
        raise f.error(None, name, fields, message)
    windowed = f.find("sliding_window") is not None and f.flag("use_sliding_window", True)
    return ["sliding" if windowed else "full"] * f.num_layers()


def _drop_shared_kv(f: ConfigFields, tags: list[str]) -> list[str]:
    """The last `num_kv_shared_layers` layers (Gemma 3n/4) reuse earlier layers' KV: no cache of their own."""
    shared = f.int("num_kv_shared_layers", minimum=0, default=0)
    if shared and shared >= len(tags):
        message = f"num_kv_shared_layers ({shared}) must be below the layer count ({len(tags)})"
        raise f.error("num_kv_shared_layers", shared, f"below {len(tags)}", message)
    keep = len(tags) - shared
    return tags[:keep] + ["recurrent" if t in RECURRENT_TAGS else "none" for t in tags[keep:]]


def _window(f: ConfigFields, tags: list[str]) -> int:
    windows = set()
    if "chunked" in tags:
        windows.add(f.int("attention_chunk_size"))
    if any(ATTENTION_OF_TAG[t] == "sliding" for t in tags):
        windows.add(f.int("sliding_window", "sliding_window_size"))
    if len(windows) > 1:
        message = (
            f"sliding_window and attention_chunk_size differ ({sorted(windows)}); one window is supported"
        )
        raise f.error("sliding_window", sorted(windows), "one window, equal to attention_chunk_size", message)
    return windows.pop()


def _head_dim(f: ConfigFields, model_type: str) -> int:
    if f.find("head_dim", "attention_head_dim") is not None:
        return f.int("head_dim", "attention_head_dim")
    width = f.int("hidden_size", "d_model") * _ATTENTION_WIDTH.get(model_type, 1)
    heads = f.int("num_attention_heads")
    if width % heads:
        message = f"hidden_size ({width}) does not split into {heads} attention heads; set head_dim"
        raise f.error("hidden_size", width, f"a multiple of {heads} heads (or head_dim set)", message)
    return width // heads


def _attention(f: ConfigFields, model_type: str, dtype: str, window: int | None) -> AttentionSpec:
    """The KV of one full-attention layer (`window` None) or one sliding-window layer."""
    if f.has("kv_lora_rank"):  # MLA: one latent of kv_lora_rank + rope dims per token
        latent = f.int("kv_lora_rank") + f.int("qk_rope_head_dim", minimum=0)
        return AttentionSpec(
            num_kv_heads=1, head_dim=latent, v_head_dim=0, dtype=dtype, sliding_window=window
        )
    kv_heads = f.int("num_key_value_heads", "num_kv_heads", default=None) or f.int("num_attention_heads")
    heads = f.int("num_attention_heads", default=None)
    if heads is not None and heads % kv_heads:
        message = f"num_attention_heads ({heads}) must be a multiple of the KV heads ({kv_heads})"
        raise f.error("num_attention_heads", heads, f"a multiple of {kv_heads}", message)
    if window is not None:  # MiMo spells its sliding layers' shapes separately
        kv_heads = f.int("swa_num_key_value_heads", default=kv_heads)
        head_dim = f.int("swa_head_dim", default=None) or _head_dim(f, model_type)
        v_head_dim = f.int("swa_v_head_dim", "v_head_dim", default=head_dim)
    else:
        if f.has("num_global_key_value_heads") and f.flag("attention_k_eq_v", True):
            kv_heads = f.int("num_global_key_value_heads")  # Gemma 4's global layers
        head_dim = f.int("global_head_dim", default=None) or _head_dim(f, model_type)
        v_head_dim = f.int("v_head_dim", default=head_dim)
    return AttentionSpec(
        num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype, sliding_window=window
    )


def _deepseek_v4(f: ConfigFields, dtype: str, common: dict[str, Any]) -> ModelSpec:
    n = f.num_layers()
    if f.has("compress_ratios"):
        ratios = f.int_list("compress_ratios")
        mtp = f.int("num_nextn_predict_layers", minimum=0, default=0)
        if len(ratios) not in (n, n + mtp):  # the Hub config appends the MTP layers' ratios
            message = f"compress_ratios has {len(ratios)} entries for {n} layers (+ {mtp} MTP layers)"
            raise f.error("compress_ratios", len(ratios), f"{n} or {n + mtp} entries", message)
    else:
        types = f.seq("layer_types")
        if len(types) != n or not all(isinstance(t, str) and t in _V4_RATIO_OF_TYPE for t in types):
            expected = f"{n} of {sorted(_V4_RATIO_OF_TYPE)}"
            raise f.error("layer_types", types, expected, f"layer_types must list {expected}; got {types}")
        ratios = [_V4_RATIO_OF_TYPE[t] for t in types]
    entry = {
        "num_kv_heads": f.int("num_key_value_heads", default=1),
        "head_dim": f.int("head_dim"),
        "v_head_dim": 0,
    }
    compressed = tuple(i for i in range(n) if ratios[i] > 1)
    return ModelSpec(
        kind=DEEPSEEK_V4,
        num_layers=n,
        full_attention_layers=compressed,
        sliding_window_layers=tuple(range(n)),
        mamba_layers=(),
        full_attention=AttentionSpec(**entry, dtype=dtype) if compressed else None,
        sliding_attention=AttentionSpec(**entry, dtype=dtype, sliding_window=f.int("sliding_window")),
        mamba=None,
        **common,
    )
