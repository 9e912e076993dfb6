"""Which model implementation fills a run's pools, what its pools are sized with, and building it.

`--model-impl`: `transformers` (Hugging Face's modeling code of a supported hybrid architecture, real
or dummy weights), `reference` (the bundled reference model: real greedy tokens, small configs) or
`synthetic` (any config at its true sizes, every byte verified). `auto` takes transformers when the
model folder holds safetensors weights of a supported architecture, else the reference model where it
can run the config, else the synthetic cache. Only a transformers run imports transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from distpool.model.dtypes import canonical_dtype
from distpool.model.hf_config import spec_from_hf
from distpool.model.shard import shard
from distpool.model.spec import ModelSpec
from distpool.model_impl.errors import ImplCannotRun, WeightOptionsUnused
from distpool.model_impl.hf.source import HFSource, holds_weights, resolve_source
from distpool.model_impl.hf.support import check_supported as check_transformers
from distpool.model_impl.hf.support import unsupported_reason as transformers_unsupported
from distpool.model_impl.pool_model import PoolModel
from distpool.model_impl.reference.layers import COMPUTE_DTYPE as REFERENCE_DTYPE
from distpool.model_impl.reference.model import ReferenceModel
from distpool.model_impl.reference.support import check_supported as check_reference
from distpool.model_impl.reference.support import unsupported_reason as reference_unsupported
from distpool.model_impl.synthetic.model import SyntheticCache

MODEL_IMPLS = ("auto", "transformers", "reference", "synthetic")


def choose_model_impl(spec: ModelSpec, requested: str, *, has_weights: bool = False) -> str:
    """The implementation `requested` resolves to for `spec` (`has_weights`: its folder holds
    safetensors weights); `ImplCannotRun` when it cannot run the spec."""
    if requested not in MODEL_IMPLS:
        raise ValueError(f"unknown model implementation {requested!r}; one of {', '.join(MODEL_IMPLS)}")
    if requested == "auto":
        if has_weights and transformers_unsupported(spec) is None:
            return "transformers"
        return "reference" if reference_unsupported(spec) is None else "synthetic"
    if requested == "reference":
        check_reference(spec)
    if requested == "transformers":
        check_transformers(spec)
    return requested


def compute_dtype(spec: ModelSpec, model_impl: str, hf: HFSource | None, kv_dtype: str | None = None) -> str:
    """The dtype a run computes in, as its summary says: the transformers runner's `--dtype`, the
    reference model's float64, or the bytes the synthetic cache writes (its KV dtype)."""
    if hf is not None:
        return hf.dtype
    if model_impl == "reference":
        return str(REFERENCE_DTYPE).removeprefix("torch.")
    return canonical_dtype(kv_dtype) if kv_dtype else spec.dtype


@dataclass(frozen=True)
class Implementation:
    """A resolved `--model-impl`: what runs, the spec its pools are sized with, its weights."""

    name: str  # "transformers" | "reference" | "synthetic"
    spec: ModelSpec
    hf: HFSource | None  # where the transformers runner's weights come from (and their bytes)


def resolve_implementation(
    config_path: Path,
    requested: str,
    *,
    load_format: str = "auto",
    dtype: str = "auto",
    on_cpu: bool = True,
    auto_transformers: bool = True,
) -> Implementation:
    """`--model-impl`, `--load-format` and `--dtype` for the config at `config_path`. A transformers
    run's spec comes from the model's modules (built on the meta device: no memory, no weights);
    the others' from the config; the runner's source also says the bytes of one copy of its weights.
    `auto_transformers=False` keeps `auto` off transformers (`check`)."""
    spec = spec_from_hf(config_path)
    has_weights = auto_transformers and holds_weights(config_path)
    name = choose_model_impl(spec, requested, has_weights=has_weights)
    if name != "transformers":
        if dtype != "auto" or load_format != "auto":
            raise WeightOptionsUnused(name, dtype, load_format)
        return Implementation(name=name, spec=spec, hf=None)
    source = resolve_source(
        config_path, load_format=load_format, dtype=dtype, checkpoint_dtype=spec.dtype, on_cpu=on_cpu
    )
    from distpool.model_impl.hf.layout import sized_spec  # imports transformers: only for this runner

    spec, weight_bytes = sized_spec(source, spec)
    return Implementation(name=name, spec=spec, hf=dataclasses.replace(source, weight_bytes=weight_bytes))


def build_model_impl(
    spec: ModelSpec,
    *,
    model_impl: str,
    seed: int,
    device: str | torch.device,
    hf: HFSource | None = None,
    tp: int = 1,
    rank: int = 0,
    group: dist.ProcessGroup | None = None,
) -> PoolModel:
    """The implementation `model_impl` names ("auto" resolves without weights), seeded and on `device`.

    `tp` > 1: rank `rank` of a tensor-parallel group, whose pool is built from `shard(spec, tp,
    rank).spec`. The reference model all-reduces over `group` (the process group of exactly the TP
    group's ranks, in rank order); the synthetic cache writes and verifies the rank's shard and
    needs no group; the transformers runner runs at TP 1 only."""
    name = choose_model_impl(spec, model_impl, has_weights=hf is not None)
    if name == "transformers":
        if tp != 1:
            raise ImplCannotRun(
                "transformers",
                spec.source,
                f"the transformers runner runs at TP 1 only (transformers has no tensor-parallel plan for "
                f"Mamba or gated delta net mixers); asked for TP {tp}",
            )
        if hf is None:
            raise ValueError("the transformers runner needs its weights' source (an HFSource)")
        from distpool.model_impl.hf.runner import TransformersRunner  # imports transformers

        return TransformersRunner(spec, hf, seed=seed, device=device)
    if name == "reference":
        return ReferenceModel.for_rank(spec, tp=tp, rank=rank, group=group, seed=seed, device=device)
    rank_shard = shard(spec, tp, rank) if tp != 1 else None
    return SyntheticCache(spec, seed=seed, device=device, shard=rank_shard)
