"""The one dtype table: canonical names, the aliases users type, and torch dtypes.

Canonical names are torch's ("bfloat16", "float8_e4m3fn", ...). Every place that takes a dtype from a
user (config.json fields, `--kv-dtype`, `PoolArgs`, `ModelSpec.with_dtypes`) goes through
`canonical_dtype`, so "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "half" and "torch.float16" mean
the same thing everywhere.
"""

from __future__ import annotations

from typing import Any

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_ALIASES = {
    **dict.fromkeys(("bfloat16", "bf16"), "bfloat16"),
    **dict.fromkeys(("float16", "fp16", "f16", "half"), "float16"),
    **dict.fromkeys(("float32", "fp32", "f32", "float"), "float32"),
    **dict.fromkeys(("float64", "fp64", "f64", "double"), "float64"),
    **dict.fromkeys(("float8_e4m3fn", "float8_e4m3", "fp8", "fp8_e4m3"), "float8_e4m3fn"),
    **dict.fromkeys(("float8_e5m2", "fp8_e5m2"), "float8_e5m2"),
}
DTYPE_NAMES = f"one of {', '.join(sorted(set(_ALIASES.values())))} (or bf16, fp16, fp32, fp8_e4m3)"


def canonical_dtype(value: Any, where: str = "dtype") -> str:
    """The canonical name of the dtype spelled `value`; `where` prefixes the error message."""
    name = value.lower().removeprefix("torch.") if isinstance(value, str) else None
    if name not in _ALIASES:
        raise ValueError(f"{where}: unknown dtype {value!r}; use {DTYPE_NAMES}")
    return _ALIASES[name]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name (canonical or alias)."""
    return TORCH_DTYPES[canonical_dtype(name)]


def dtype_bytes(name: str) -> int:
    return torch_dtype(name).itemsize
