"""Model presets: public Hugging Face `config.json` files that ship with distpool, named for the CLI.

Each `<name>.json` here is the public config of one hybrid model, trimmed to the fields that decide
its layers, KV and state (as in tests/fixtures). `resolve_model` turns what a user types after
`distpool check` or `run --model` into a config path; `preset_rows` are the rows of the `distpool
presets` table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from distpool.model.convention import in_transformers_convention
from distpool.model.hf_config import spec_from_hf
from distpool.model.spec import ModelSpec

PRESETS_DIR = Path(__file__).parent


def preset_names() -> list[str]:
    """Every preset, sorted: the file names here without `.json`."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def resolve_model(name_or_path: str) -> Path:
    """The config.json a preset name or a path stands for.

    A preset name wins over a file of the same name in the working directory (write `./NAME` for the
    file). A directory must hold a `config.json`. Anything else raises ValueError naming the input and
    listing the presets.
    """
    if name_or_path in preset_names():
        return PRESETS_DIR / f"{name_or_path}.json"
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    found = "no config.json in that directory" if path.is_dir() else "no such file"
    raise ValueError(
        f"{name_or_path}: {found}, and no preset of that name; pass a config.json, a directory holding "
        f"one, or a preset: {', '.join(preset_names())}"
    )


@dataclass(frozen=True)
class PresetRow:
    """One line of `distpool presets`: the figures `check` reports, before any pool is sized."""

    name: str
    architecture: str
    kind: str
    num_attention_layers: int  # full and sliding-window
    num_mamba_layers: int
    slot_bytes: int  # one request's recurrent state over every Mamba layer (unpadded)
    kv_bytes_per_token: int  # K and V of one token over every attention layer
    kv_dtype: str
    ssm_dtype: str | None  # the recurrent state's dtype; None without Mamba layers
    state_convention: str  # what slot_bytes follows: the engine convention (convention.py)
    # The transformers runner's slot (its convention) computing in the checkpoint's dtype, and in
    # float32 (a CPU's default); None where its runner keeps no such state.
    transformers_slot_bytes: int | None
    transformers_slot_bytes_float32: int | None


def preset_rows() -> list[PresetRow]:
    """Every preset, classified with the dtypes its config states (SSM state: float32 unless set)."""
    rows = []
    for name in preset_names():
        spec = spec_from_hf(PRESETS_DIR / f"{name}.json")
        attention = spec.full_attention or spec.sliding_attention
        rows.append(
            PresetRow(
                name=name,
                architecture=", ".join(spec.architectures) or spec.model_type,
                kind=spec.kind,
                num_attention_layers=spec.num_full_attention_layers + spec.num_sliding_window_layers,
                num_mamba_layers=spec.num_mamba_layers,
                slot_bytes=spec.slot_bytes,
                kv_bytes_per_token=spec.full_kv_bytes_per_token + spec.swa_kv_bytes_per_token,
                kv_dtype=attention.dtype if attention else spec.dtype,
                # slot order puts the SSM / recurrent state last (MambaSpec)
                ssm_dtype=spec.mamba.tensors[-1].dtype if spec.mamba else None,
                state_convention=spec.state_convention,
                transformers_slot_bytes=_transformers_slot_bytes(spec, spec.dtype),
                transformers_slot_bytes_float32=_transformers_slot_bytes(spec, "float32"),
            )
        )
    return rows


def _transformers_slot_bytes(spec: ModelSpec, dtype: str) -> int | None:
    try:
        return in_transformers_convention(spec, dtype).slot_bytes
    except ValueError:  # a state family transformers' runner does not keep
        return None
