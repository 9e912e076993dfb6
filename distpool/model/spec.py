"""What the pool needs to know about a model: layer kinds, KV widths, state shapes, dtypes.

A `ModelSpec` is derived once from a Hugging Face `config.json` (`distpool.model.hf_config.spec_from_hf`)
and is frozen. Only the `hf_*` modules of this package know Hugging Face field names; everything else
works from the spec, and the spec is what crosses process boundaries (never the raw config). Its
`state_convention` says how its recurrent state is kept (`convention.py`): the engine convention of
SGLang and vLLM, or transformers' own when its modeling code runs.
Every size here is raw (unpadded); the arena adds its own alignment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from distpool.facts import Facts
from distpool.model.dtypes import canonical_dtype, dtype_bytes
from distpool.model.shard_rule import Segment, ShardRule, ShardTable, TensorRule

# Model kinds: attention mixed with Mamba / linear attention, attention mixed with sliding-window
# attention, DeepSeek-V4 (compressed attention, no unified pool), and dense (nothing to unify).
HYBRID_MAMBA = "hybrid_mamba"
HYBRID_SWA = "hybrid_swa"
DEEPSEEK_V4 = "deepseek_v4"
DENSE = "dense"
MODEL_KINDS = (HYBRID_MAMBA, HYBRID_SWA, DEEPSEEK_V4, DENSE)
# Conventions of keeping a recurrent state (`convention.py` says what differs).
ENGINE_CONVENTION = "engine"
TRANSFORMERS_CONVENTION = "transformers"
STATE_CONVENTIONS = (ENGINE_CONVENTION, TRANSFORMERS_CONVENTION)
# ModelSpec fields that describe compute, not memory: outside the layout fingerprint.
COMPUTE_FIELDS = ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size", "norm_eps")


class SpecInvalid(Facts, ValueError):
    """A `ModelSpec` whose fields contradict each other: `field` holds `value`, and must be `expected`."""

    def __init__(self, source: str, field: str, value: object, expected: str) -> None:
        super().__init__(f"{source}: ModelSpec.{field} is {value!r}; it must be {expected}")
        self.source, self.field, self.value, self.expected = source, field, value, expected


class SpecLacks(Facts, ValueError):
    """Code that serves only models with `layer_kind` ("full_attention", "mamba") got a spec without it."""

    def __init__(self, source: str, layer_kind: str) -> None:
        super().__init__(f"{source} has no {layer_kind} layers")
        self.source, self.layer_kind = source, layer_kind


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class AttentionSpec:
    """KV cache shape of one attention layer kind (full or sliding window).

    K is `(num_kv_heads, head_dim)` per token and V is `(num_kv_heads, v_head_dim)`.
    MLA models cache one latent per token: `num_kv_heads=1`, `head_dim=kv_lora_rank + rope dim`,
    `v_head_dim=0`.
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    sliding_window: int | None = None  # tokens; None for full attention

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one token occupies in one layer."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * dtype_bytes(self.dtype)

    @property
    def shard_rule(self) -> ShardRule:
        """K and V of a token, (kv_heads, dim), split by KV heads; replicated when TP exceeds them
        (MLA's one latent is replicated on every rank)."""
        heads = Segment("heads", "KV heads", count=self.num_kv_heads, width=1, replicable=True)
        return ShardRule(axis=0, segments=(heads,))


def _kv_tensors(attention: AttentionSpec) -> list[tuple[str, tuple[int, int], str]]:
    """(name, (kv_heads, dim), dtype) of K and V of one token; MLA caches no V."""
    kv = (("k", attention.head_dim), ("v", attention.v_head_dim))
    return [(name, (attention.num_kv_heads, dim), attention.dtype) for name, dim in kv if dim]


@dataclass(frozen=True)
class StateTensorSpec:
    """One per-request recurrent state tensor of one Mamba-like layer (e.g. conv or ssm)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return _prod(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class MambaSpec:
    """Recurrent state of one Mamba / linear-attention layer.

    `family` is one of mamba2, mamba1, gated_delta_net, kda, short_conv. `tensors` lists the
    state tensors in slot order: conv state(s) first, then the SSM / recurrent state.
    `shard_rules` says how a TP group splits each of them (same order); empty when unknown, which
    limits the model to TP 1.
    """

    family: str
    tensors: tuple[StateTensorSpec, ...]
    shard_rules: tuple[ShardRule, ...] = ()

    @property
    def bytes_per_layer(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ModelSpec:
    """Everything the pool needs to know about one model. Build with `hf_config.spec_from_hf`."""

    kind: str
    architectures: tuple[str, ...]
    model_type: str
    num_layers: int
    full_attention_layers: tuple[int, ...]
    sliding_window_layers: tuple[int, ...]
    mamba_layers: tuple[int, ...]
    full_attention: AttentionSpec | None
    sliding_attention: AttentionSpec | None
    mamba: MambaSpec | None
    dtype: str  # the model's own dtype
    # The model's compute dimensions (0 where the config does not say); pools ignore them, the
    # reference model runs from them.
    hidden_size: int = 0
    vocab_size: int = 0
    num_attention_heads: int = 0
    intermediate_size: int = 0
    norm_eps: float = 1e-5
    source: str = "<dict>"
    # How the state tensors are kept: the engine's conv of kernel - 1 columns, or transformers'
    # conv of kernel columns (and its dtypes). Their shapes already differ, so it is a label for
    # people and checks, outside the layout fingerprint.
    state_convention: str = ENGINE_CONVENTION

    def needs_full_attention(self) -> AttentionSpec:
        """The full-attention KV, for code that serves only models with it (`SpecLacks` otherwise)."""
        if self.full_attention is None:
            raise SpecLacks(self.source, "full_attention")
        return self.full_attention

    def needs_mamba(self) -> MambaSpec:
        """The recurrent state, for code that serves only models with it (`SpecLacks` otherwise)."""
        if self.mamba is None:
            raise SpecLacks(self.source, "mamba")
        return self.mamba

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise SpecInvalid(self.source, "kind", self.kind, f"one of {', '.join(MODEL_KINDS)}")
        if self.state_convention not in STATE_CONVENTIONS:
            raise SpecInvalid(
                self.source,
                "state_convention",
                self.state_convention,
                f"one of {', '.join(STATE_CONVENTIONS)}",
            )
        for field, layers, field_of_layers in (
            ("full_attention", self.full_attention_layers, self.full_attention),
            ("sliding_attention", self.sliding_window_layers, self.sliding_attention),
            ("mamba", self.mamba_layers, self.mamba),
        ):
            if (field_of_layers is None) != (not layers):
                given = "none" if field_of_layers is None else "one"
                raise SpecInvalid(self.source, field, given, f"one exactly when the spec has {field} layers")

    # ---- layer counts ------------------------------------------------------------------
    @property
    def num_full_attention_layers(self) -> int:
        return len(self.full_attention_layers)

    @property
    def num_sliding_window_layers(self) -> int:
        return len(self.sliding_window_layers)

    @property
    def num_mamba_layers(self) -> int:
        return len(self.mamba_layers)

    @property
    def is_hybrid(self) -> bool:
        return self.kind in (HYBRID_MAMBA, HYBRID_SWA)

    # ---- byte sizes --------------------------------------------------------------------
    @property
    def full_kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over every full-attention layer."""
        if self.full_attention is None:
            return 0
        return self.num_full_attention_layers * self.full_attention.bytes_per_token

    @property
    def swa_kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over every sliding-window layer."""
        if self.sliding_attention is None:
            return 0
        return self.num_sliding_window_layers * self.sliding_attention.bytes_per_token

    @property
    def slot_bytes(self) -> int:
        """One request's whole recurrent state over every Mamba layer (unpadded)."""
        if self.mamba is None:
            return 0
        return self.num_mamba_layers * self.mamba.bytes_per_layer

    def layer_tensors(self, layer: int) -> tuple[StateTensorSpec, ...]:
        """What layer `layer` keeps per request: K and V of one token (`(kv_heads, dim)`; `swa_k`,
        `swa_v` for a sliding-window layer) and its state tensors, in that order; () for none."""
        out = []
        for prefix, layers, attention in (
            ("", self.full_attention_layers, self.full_attention),
            ("swa_", self.sliding_window_layers, self.sliding_attention),
        ):
            if layer in layers and attention is not None:  # (one exactly when there are layers)
                out += [StateTensorSpec(prefix + n, s, d) for n, s, d in _kv_tensors(attention)]
        if layer in self.mamba_layers and self.mamba is not None:
            out += self.mamba.tensors
        return tuple(out)

    @property
    def sliding_window(self) -> int | None:
        return None if self.sliding_attention is None else self.sliding_attention.sliding_window

    def with_dtypes(
        self, *, kv_dtype: str | None = None, conv_dtype: str | None = None, ssm_dtype: str | None = None
    ) -> ModelSpec:
        """A copy with the KV, conv-state and SSM-state dtypes overridden (None keeps the spec's own)."""
        kv_dtype, conv_dtype, ssm_dtype = (
            None if name is None else canonical_dtype(name, what)
            for name, what in ((kv_dtype, "kv dtype"), (conv_dtype, "conv dtype"), (ssm_dtype, "ssm dtype"))
        )
        full, swa, mamba = self.full_attention, self.sliding_attention, self.mamba
        if kv_dtype is not None:
            full = full and dataclasses.replace(full, dtype=kv_dtype)
            swa = swa and dataclasses.replace(swa, dtype=kv_dtype)
        if mamba is not None and (conv_dtype or ssm_dtype):
            tensors = tuple(
                dataclasses.replace(
                    t, dtype=(conv_dtype if t.name.startswith("conv") else ssm_dtype) or t.dtype
                )
                for t in mamba.tensors
            )
            mamba = dataclasses.replace(mamba, tensors=tensors)
        return dataclasses.replace(self, full_attention=full, sliding_attention=swa, mamba=mamba)

    # ---- tensor parallelism ------------------------------------------------------------
    @property
    def shard_table(self) -> ShardTable:
        """How a TP group splits every cached tensor (`distpool.model.shard` applies it)."""
        tensors = []
        for prefix, attention in (("", self.full_attention), ("swa_", self.sliding_attention)):
            if attention is not None:
                for name, shape, dtype in _kv_tensors(attention):
                    tensors.append(TensorRule(prefix + name, shape, dtype, attention.shard_rule))
        if self.mamba is not None:
            rules = self.mamba.shard_rules or (None,) * len(self.mamba.tensors)
            for tensor, rule in zip(self.mamba.tensors, rules, strict=True):
                tensors.append(TensorRule(tensor.name, tensor.shape, tensor.dtype, rule))
        queries = (("query heads", self.num_attention_heads),) if self.num_attention_heads else ()
        return ShardTable(tensors=tuple(tensors), split_counts=queries)

    # ---- identity ----------------------------------------------------------------------
    def layout_fields(self) -> dict[str, Any]:
        """The fields that decide byte layout (what a layout fingerprint must cover).

        Shard rules are left out: they say which coordinates a TP rank holds, not where a byte of
        one pool lives (a rank's own shapes are in its spec); the TP handshake compares them."""
        fields = dataclasses.asdict(self)
        for name in ("source", "architectures", "model_type", "dtype", "state_convention", *COMPUTE_FIELDS):
            fields.pop(name)
        if fields["mamba"] is not None:
            fields["mamba"].pop("shard_rules")
        return fields
