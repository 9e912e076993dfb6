"""The layer schedule of a Hugging Face config: what kind of memory each decoder layer keeps.

Only `distpool.model.hf_config` uses this module. A *schedule* is one tag per decoder layer:

    full            full attention (KV grows with the sequence)
    sliding         sliding-window attention (`sliding_window` tokens)
    chunked         chunked local attention (Llama 4; `attention_chunk_size` tokens, counted as sliding)
    recurrent       Mamba / linear attention / short conv (fixed-size state)
    hybrid          full attention and a recurrent state in one layer (Falcon-H1, Zamba2 "hybrid")
    hybrid_sliding  sliding-window attention and a recurrent state in one layer
    none            no per-request memory (Nemotron-H MLP / MoE blocks, KV-sharing layers)

Schedule readers are tried in table order; the first whose field is present decides every layer.
"""

from __future__ import annotations

from collections.abc import Callable

from distpool.model.hf_families import FAMILIES
from distpool.model.hf_fields import MAX_LAYERS, ConfigFields, ConfigInvalid

# The attention a tagged layer caches (None: no KV), and the tags that keep a recurrent state.
ATTENTION_OF_TAG = {"full": "full", "hybrid": "full", "sliding": "sliding", "hybrid_sliding": "sliding"}
ATTENTION_OF_TAG |= {"chunked": "chunked", "recurrent": None, "none": None}
RECURRENT_TAGS = frozenset({"recurrent", "hybrid", "hybrid_sliding"})

# Values of `layer_types` / `layers_block_type` across transformers' config classes and Hub configs.
_LAYER_TYPE_TAGS = {
    **dict.fromkeys(("full_attention", "attention", "global_attention", "global", "full"), "full"),
    # Sparse attention with an indexer (DeepSeek-V3.2 DSA, MiniMax-M3) still caches every token's KV.
    **dict.fromkeys(("deepseek_sparse_attention", "indexed_attention", "minimax_m3_sparse"), "full"),
    **dict.fromkeys(("sliding_attention", "sliding_window_attention", "local_attention", "local"), "sliding"),
    "chunked_attention": "chunked",
    **dict.fromkeys(("linear_attention", "mamba", "mamba2", "conv", "short_conv", "linear"), "recurrent"),
    "hybrid": "hybrid",
    "hybrid_sliding": "hybrid_sliding",
    **dict.fromkeys(("mlp", "moe", "dense", "sparse"), "none"),
}
# Nemotron-H `hybrid_override_pattern`: M Mamba2, * attention, - MLP, E MoE.
_PATTERN_TAGS = {"M": "recurrent", "*": "full", "-": "none", "E": "none"}
Reader = Callable[[ConfigFields, str], "list[str] | None"]


def _checked_length(f: ConfigFields, field: str, tags: list[str]) -> list[str]:
    """Explicit per-layer lists decide the layer count; a stated `num_hidden_layers` must agree."""
    stated = f.num_layers(default=None)
    if not tags or (stated is not None and stated != len(tags)):
        message = f"field {f.name(field)!r} lists {len(tags)} layers but num_hidden_layers is {stated}"
        raise f.error(field, len(tags), f"{stated} layers (num_hidden_layers)", message)
    return tags


def _named_types(field: str) -> Reader:
    def read(f: ConfigFields, _: str) -> list[str] | None:
        if f.data.get(field) is None:
            return None
        tags = []
        for i, value in enumerate(f.seq(field)):
            tag = _LAYER_TYPE_TAGS.get(value.lower()) if isinstance(value, str) else None
            if tag is None:
                known = ", ".join(sorted(_LAYER_TYPE_TAGS))
                message = f"field {f.name(field)}[{i}] is {value!r}, not a known layer type ({known})"
                raise f.error(f"{field}[{i}]", value, f"one of {known}", message)
            tags.append(tag)
        return _checked_length(f, field, tags)

    return read


def _override_pattern(f: ConfigFields, _: str) -> list[str] | None:
    pattern = f.text("hybrid_override_pattern")
    if pattern is None:
        return None
    if len(pattern) > MAX_LAYERS:
        message = (
            f"field {f.name('hybrid_override_pattern')!r} has {len(pattern)} layers; at most {MAX_LAYERS}"
        )
        raise f.error("hybrid_override_pattern", len(pattern), f"at most {MAX_LAYERS} layers", message)
    bad = sorted({c for c in pattern if c not in _PATTERN_TAGS})
    if bad:
        message = f"field {f.name('hybrid_override_pattern')!r} has unknown characters {bad} (known: M * - E)"
        raise f.error("hybrid_override_pattern", bad, "characters among M * - E", message)
    return _checked_length(f, "hybrid_override_pattern", [_PATTERN_TAGS[c] for c in pattern])


def _indices(f: ConfigFields, field: str, n: int, first: int = 0) -> set[int]:
    values = f.int_list(field, minimum=first)
    out = {v - first for v in values}
    if any(i >= n for i in out) or len(out) != len(values):
        message = f"field {f.name(field)!r} = {values} must name distinct layers among {n}"
        raise f.error(field, values, f"distinct layers among {n}", message)
    return out


def _kimi_linear(f: ConfigFields, _: str) -> list[str] | None:
    """Kimi-Linear: `linear_attn_config` lists 1-based `full_attn_layers` and `kda_layers`."""
    if not f.has("linear_attn_config"):
        return None
    sub, n = f.sub("linear_attn_config"), f.num_layers()
    if not sub.has("full_attn_layers"):
        return None
    full, kda = _indices(sub, "full_attn_layers", n, first=1), _indices(sub, "kda_layers", n, first=1)
    if full & kda or len(full | kda) != n:
        message = f"{sub.name('full_attn_layers')} and {sub.name('kda_layers')} must split all {n} layers"
        raise sub.error(
            "full_attn_layers", sorted(full), f"the layers among {n} that kda_layers does not list", message
        )
    return ["full" if i in full else "recurrent" for i in range(n)]


def _binary_list(field: str, one: str, zero: str) -> Reader:
    def read(f: ConfigFields, _: str) -> list[str] | None:
        if f.data.get(field) is None:
            return None
        values = f.int_list(field)
        if any(v > 1 for v in values):
            raise f.error(
                field, values, "only 0 and 1", f"field {f.name(field)!r} must hold only 0 and 1, got {values}"
            )
        return _checked_length(f, field, [one if v else zero for v in values])

    return read


def _by_index(field: str, listed: str, others: str) -> Reader:
    def read(f: ConfigFields, _: str) -> list[str] | None:
        if not f.has(field):
            return None
        n = f.num_layers()
        chosen = _indices(f, field, n)
        return [listed if i in chosen else others for i in range(n)]

    return read


def _jamba_period(f: ConfigFields, _: str) -> list[str] | None:
    if f.find("attn_layer_period") is None:  # (Jamba's config class defaults it to 8)
        return None
    period, offset, n = f.int("attn_layer_period"), f.int("attn_layer_offset", minimum=0), f.num_layers()
    if offset >= period:
        message = f"attn_layer_offset ({offset}) must be smaller than attn_layer_period ({period})"
        raise f.error("attn_layer_offset", offset, f"below {period} (attn_layer_period)", message)
    return ["full" if i % period == offset else "recurrent" for i in range(n)]


def _every_nth(field: str, nth: str, others: str) -> Reader:
    """Layer i is `nth` when (i + 1) is a multiple of the field's value (Qwen3-Next, Gemma 2/3)."""

    def read(f: ConfigFields, _: str) -> list[str] | None:
        # A window pattern without a window (Gemma with sliding_window null) leaves every layer global.
        if f.find(field) is None or (others == "sliding" and f.find("sliding_window") is None):
            return None
        every, n = f.int(field), f.num_layers()
        return [nth if (i + 1) % every == 0 else others for i in range(n)]

    return read


def _llama4_chunks(f: ConfigFields, model_type: str) -> list[str] | None:
    """Llama 4: `no_rope_layers[i]` is 1 where layer i uses RoPE and attends within its chunk."""
    if not f.has("attention_chunk_size"):
        return None
    n = f.num_layers()
    if f.data.get("no_rope_layers"):
        flags = f.int_list("no_rope_layers")
        if len(flags) != n or any(v > 1 for v in flags):
            expected = f"{n} values of 0 or 1"
            message = f"field {f.name('no_rope_layers')!r} must hold {expected}, got {flags}"
            raise f.error("no_rope_layers", flags, expected, message)
    elif model_type in ("llama4", "llama4_text"):  # transformers' default: every 4th layer is NoPE, global
        every = f.int("no_rope_layer_interval", default=4)
        flags = [int((i + 1) % every != 0) for i in range(n)]
    else:
        return None
    return ["chunked" if v else "full" for v in flags]


SCHEDULE_READERS: tuple[tuple[str, Reader], ...] = (
    ("linear_attn_config", _kimi_linear),
    ("hybrid_override_pattern", _override_pattern),  # Nemotron-H (Hub)
    ("layers_block_type", _named_types("layers_block_type")),  # Nemotron-H (transformers), Zamba2
    ("layer_types", _named_types("layer_types")),
    ("hybrid_layer_pattern", _binary_list("hybrid_layer_pattern", "sliding", "full")),  # MiMo: 1 = SWA
    ("attn_type_list", _binary_list("attn_type_list", "full", "recurrent")),  # MiniMax: 0 = linear
    ("attn_layer_indices", _by_index("attn_layer_indices", "full", "recurrent")),  # Bamba
    ("attn_layer_period", _jamba_period),  # Jamba
    ("full_attention_interval", _every_nth("full_attention_interval", "full", "recurrent")),  # Qwen3-Next
    ("full_attn_idxs", _by_index("full_attn_idxs", "full", "recurrent")),  # LFM2
    ("hybrid_layer_ids", _by_index("hybrid_layer_ids", "hybrid", "recurrent")),  # Zamba2
    ("attention_chunk_size", _llama4_chunks),
    ("sliding_window_pattern", _every_nth("sliding_window_pattern", "full", "sliding")),  # Gemma 2/3
)
SCHEDULE_FIELDS = tuple(name for name, _ in SCHEDULE_READERS)


class ScheduleMissing(ConfigInvalid):
    """A config of `model_type`, whose family (`family`) keeps a recurrent state in some layers, names
    none of the layer schedule fields (`SCHEDULE_FIELDS`): read as a plain transformer, it would keep
    no state at all."""

    def __init__(self, source: str, model_type: str, family: str) -> None:
        fields = ", ".join(SCHEDULE_FIELDS)
        message = (
            f"a {model_type} model keeps {family} state in some layers, but its config names none of the "
            f"layer schedule fields ({fields})"
        )
        super().__init__(source, None, model_type, f"one of {fields}", message)
        self.model_type, self.family = model_type, family


def layer_schedule(f: ConfigFields, model_type: str) -> list[str] | None:
    """One tag per layer, or None when nothing but a uniform transformer layout is stated."""
    for _, read in SCHEDULE_READERS:
        tags = read(f, model_type)
        if tags is not None:
            return tags
    family, _, every_layer = FAMILIES.get(model_type, (None, {}, None))
    if family is not None and every_layer is None:
        # Without its schedule, such a config would read as a plain transformer: no state at all.
        raise ScheduleMissing(f.source, model_type, family)
    return [every_layer] * f.num_layers() if every_layer else None
