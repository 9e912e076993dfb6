"""Which architectures the transformers runner serves, decided from the spec alone (no transformers)."""

from __future__ import annotations

from dataclasses import dataclass

from distpool.model.spec import ModelSpec
from distpool.model_impl.errors import ImplCannotRun


@dataclass(frozen=True)
class Architecture:
    """One architecture the runner serves and what its modeling code can do."""

    name: str  # as config.json's `architectures` spells it
    model_type: str
    # Whether its multi-token scan starts from a given state, so a prefill continues a checkpoint
    # in one pass. Jamba's selective scan starts from zeros: its prefill continues token by token.
    continues_in_one_pass: bool
    verified_with: str  # what the test suite checks it with (README)


_VERIFIED = "tiny seeded checkpoint, float64: 1P1D prompts and multi-turn runs equal to generate"
ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("BambaForCausalLM", "bamba", True, f"{_VERIFIED} (Mamba2)"),
        Architecture("NemotronHForCausalLM", "nemotron_h", True, f"{_VERIFIED} (Mamba2, MLP layers)"),
        Architecture("Qwen3NextForCausalLM", "qwen3_next", True, f"{_VERIFIED} (gated delta net, MoE)"),
        Architecture("FalconH1ForCausalLM", "falcon_h1", True, f"{_VERIFIED} (attention beside Mamba2)"),
        Architecture("JambaForCausalLM", "jamba", False, f"{_VERIFIED} (Mamba1, MoE)"),
        Architecture("GraniteMoeHybridForCausalLM", "granitemoehybrid", True, f"{_VERIFIED} (Mamba2, MoE)"),
    )
}
_BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}


def architecture_of(spec: ModelSpec) -> Architecture | None:
    """The supported architecture `spec` names (its `architectures`, else its `model_type`), or None."""
    named = [ARCHITECTURES[name] for name in spec.architectures if name in ARCHITECTURES]
    if named:
        return named[0]
    return _BY_MODEL_TYPE.get(spec.model_type) if not spec.architectures else None


def unsupported_reason(spec: ModelSpec) -> str | None:
    """Why the transformers runner cannot serve `spec`, or None when it can."""
    if architecture_of(spec) is not None:
        return None
    name = ", ".join(spec.architectures) or spec.model_type or "(no architectures, no model_type)"
    served = ", ".join(ARCHITECTURES)
    return f"{spec.source}: the transformers runner serves {served}; {name} is not one of them"


def check_supported(spec: ModelSpec) -> Architecture:
    """The architecture the runner serves `spec` as; `ImplCannotRun` when it serves none."""
    architecture = architecture_of(spec)
    if architecture is None:
        raise ImplCannotRun("transformers", spec.source, unsupported_reason(spec) or "")
    return architecture
