"""Which specs the reference model can run: decided from the spec alone, with why when it cannot."""

from __future__ import annotations

from distpool.model.spec import HYBRID_MAMBA, ModelSpec
from distpool.model_impl.errors import NOT_MAMBA2_HYBRID, TOO_LARGE, ImplCannotRun

MAX_PARAMS = 64_000_000


def approx_params(spec: ModelSpec) -> int:
    """Embeddings, head, and ~12 h^2 per layer: enough to tell a toy from a real checkpoint."""
    return 2 * spec.vocab_size * spec.hidden_size + 12 * spec.num_layers * spec.hidden_size**2


def unsupported_reason(spec: ModelSpec) -> str | None:
    """Why the reference model cannot run `spec`, or None when it can. From the spec alone."""
    refusal = _refusal(spec)
    return None if refusal is None else refusal[1]


def _refusal(spec: ModelSpec) -> tuple[str | None, str] | None:
    """(the problem code, or None: another, the reason) when the reference model cannot run `spec`."""
    name = ", ".join(spec.architectures) or spec.model_type or spec.source
    if (
        spec.kind != HYBRID_MAMBA
        or spec.mamba is None
        or spec.mamba.family != "mamba2"
        or (spec.sliding_window_layers or set(spec.full_attention_layers) & set(spec.mamba_layers))
    ):
        state = f" with {spec.mamba.family} state" if spec.mamba is not None else ""
        return NOT_MAMBA2_HYBRID, (
            f"the reference model runs hybrid Mamba2 models only (attention and Mamba2 in separate layers); "
            f"{spec.source} ({name}) is {spec.kind}{state}"
        )
    attention = spec.needs_full_attention()
    dims = {
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "num_attention_heads": spec.num_attention_heads,
        "intermediate_size": spec.intermediate_size,
    }
    if missing := [k for k, v in dims.items() if v <= 0]:
        return None, f"{spec.source} does not state {', '.join(missing)}, which the reference model needs"
    if spec.num_attention_heads % attention.num_kv_heads or attention.v_head_dim != attention.head_dim:
        return None, f"{spec.source}: attention heads must group over KV heads, with V as wide as K"
    if approx_params(spec) > MAX_PARAMS:
        return TOO_LARGE, (
            f"{spec.source} describes a model of about {approx_params(spec) / 1e6:.0f} M parameters; the "
            "reference model builds random weights for small configs only "
            f"(at most {MAX_PARAMS / 1e6:.0f} M)"
        )
    return None


def check_supported(spec: ModelSpec) -> None:
    """`ImplCannotRun` unless the reference model can run `spec`."""
    if (refusal := _refusal(spec)) is not None:
        problem, reason = refusal
        raise ImplCannotRun("reference", spec.source, reason, problem)
