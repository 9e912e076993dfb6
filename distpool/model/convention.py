"""Two conventions of keeping the same recurrent state, and the transformers runner's sizes from a spec.

`spec_from_hf` sizes a model as the serving engines keep it; transformers' modeling code keeps the
same state differently, and the transformers runner's pools hold what that code keeps:

                   engine (SGLang, vLLM; `spec_from_hf`)      transformers (its modeling code)
    conv state     (channels, kernel - 1), model dtype        (channels, kernel), compute dtype
    SSM state      float32 unless the config sets its dtype   float32 (Mamba2, gated delta net);
                   (`mamba_ssm_cache_dtype`)                  Mamba1: the compute dtype, at least float32
    K and V        model dtype                                compute dtype

transformers pads its conv state to the kernel's full width (the newest input joins before the conv
runs), where the engines keep only the kernel - 1 inputs the next step needs; its scans return the
state in float32, or wider. Neither is wrong; a figure must say which one it follows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from distpool.model.dtypes import canonical_dtype, torch_dtype
from distpool.model.spec import ENGINE_CONVENTION, TRANSFORMERS_CONVENTION, ModelSpec

# The dtype transformers' scan leaves the recurrent state in, per state family, from the compute dtype.
RECURRENT_DTYPE: dict[str, Callable[[torch.dtype], torch.dtype]] = {
    "mamba2": lambda compute: torch.float32,
    "gated_delta_net": lambda compute: torch.float32,
    "mamba1": lambda compute: torch.promote_types(compute, torch.float32),
}


def recurrent_dtype(family: str, compute_dtype: str) -> str:
    """The canonical name of the dtype transformers keeps `family`'s recurrent state in."""
    return str(RECURRENT_DTYPE[family](torch_dtype(compute_dtype))).removeprefix("torch.")


def in_transformers_convention(spec: ModelSpec, compute_dtype: str) -> ModelSpec:
    """`spec` (engine convention) as transformers' modeling code keeps it when computing in
    `compute_dtype`: what the transformers runner's pools hold, without transformers. ValueError for
    a state family transformers' runner does not keep."""
    if spec.state_convention != ENGINE_CONVENTION:
        raise ValueError(f"{spec.source}: the spec already follows the {spec.state_convention} convention")
    compute = canonical_dtype(compute_dtype, "compute dtype")
    full, swa, mamba = spec.full_attention, spec.sliding_attention, spec.mamba
    full = full and dataclasses.replace(full, dtype=compute)
    swa = swa and dataclasses.replace(swa, dtype=compute)
    if mamba is not None:
        if mamba.family not in RECURRENT_DTYPE or len(mamba.tensors) != 2:
            raise ValueError(
                f"{spec.source}: transformers' convention is known for {', '.join(RECURRENT_DTYPE)} "
                f"state; this model keeps {mamba.family} state"
            )
        conv, recurrent = mamba.tensors  # slot order: conv first (MambaSpec)
        channels, columns = conv.shape
        tensors = (
            dataclasses.replace(conv, shape=(channels, columns + 1), dtype=compute),
            dataclasses.replace(recurrent, dtype=recurrent_dtype(mamba.family, compute)),
        )
        mamba = dataclasses.replace(mamba, tensors=tensors)
    return dataclasses.replace(
        spec,
        full_attention=full,
        sliding_attention=swa,
        mamba=mamba,
        dtype=compute,
        state_convention=TRANSFORMERS_CONVENTION,
    )
