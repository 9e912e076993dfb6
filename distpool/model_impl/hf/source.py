"""Where the transformers runner's weights come from and in what dtype it computes (no transformers).

`--load-format` (as in vLLM): `safetensors` reads `*.safetensors` from the model folder (a sharded
checkpoint's `model.safetensors.index.json` included) through transformers, offline; `dummy` draws
seeded random weights from the config alone, for tests and sizing runs; `auto` is `safetensors`, and
refuses a folder without weights with the fix. `--dtype` is the runner's compute dtype and the dtype of
the KV and state it keeps in the pool: `auto` is the checkpoint's own, except float32 for a bfloat16
checkpoint on a CPU (which has no fast bfloat16 path), unless asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from distpool.model.dtypes import canonical_dtype
from distpool.model_impl.errors import CheckpointDtypeUnsupported, NoWeights

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = ("auto", "float64", "float32", "bfloat16", "float16")
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True)
class HFSource:
    """The resolved model the runner loads: every worker (and the parity oracle) loads its own copy."""

    path: str  # the folder holding config.json (and the weights), or a config file (dummy weights)
    load_format: str  # "safetensors" | "dummy"
    dtype: str  # float64 | float32 | bfloat16 | float16
    weight_bytes: int = 0  # one copy of the weights in `dtype` (what each process that loads it holds)

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS[1:]:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS[1:])}; got {self.load_format!r}"
            )
        if self.dtype not in DTYPES[1:]:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES[1:])}; got {self.dtype!r}")


def model_folder(config_path: Path) -> Path:
    """The folder a config path stands for (`resolve_model` gives `DIR/config.json` for a folder)."""
    return config_path.parent if config_path.name == "config.json" else config_path


def holds_weights(config_path: Path) -> bool:
    """Whether the model's folder holds safetensors weights next to its config.json."""
    if config_path.name != "config.json":
        return False  # a preset or a loose config file: a config, never weights
    folder = config_path.parent
    return any(next(folder.glob(pattern), None) is not None for pattern in WEIGHT_FILES)


def resolve_source(
    config_path: Path, *, load_format: str, dtype: str, checkpoint_dtype: str, on_cpu: bool
) -> HFSource:
    """The `HFSource` for a load format and a dtype ("auto": the checkpoint's, float32 for bfloat16 on
    a CPU): `NoWeights` or `CheckpointDtypeUnsupported` for what cannot load."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if load_format != "dummy" and not holds_weights(config_path):
        raise NoWeights(str(model_folder(config_path)), load_format)
    if dtype == "auto":
        dtype = canonical_dtype(checkpoint_dtype, "the checkpoint's dtype")
        if dtype == "bfloat16" and on_cpu:
            dtype = "float32"
        if dtype not in DTYPES:
            raise CheckpointDtypeUnsupported(dtype, DTYPES[1:])
    path = model_folder(config_path) if config_path.name == "config.json" else config_path
    return HFSource(
        path=str(path), load_format="dummy" if load_format == "dummy" else "safetensors", dtype=dtype
    )
