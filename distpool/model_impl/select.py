"""Which cache fills a worker's pool: the reference model (real tokens, small configs) or the
synthetic cache (any size, every byte verifiable)."""

from __future__ import annotations

import torch

from distpool.model.spec import ModelSpec
from distpool.model_impl.reference.model import ReferenceModel, unsupported_reason
from distpool.model_impl.synthetic.model import SyntheticCache

CACHES = ("auto", "reference", "synthetic")


def choose_cache(spec: ModelSpec, cache: str) -> str:
    """The cache to run for `cache` ("reference" or "synthetic"); "auto" takes the reference model
    where it can run the spec."""
    if cache not in CACHES:
        raise ValueError(f"unknown cache {cache!r}; choose one of {', '.join(CACHES)}")
    reason = unsupported_reason(spec)
    if cache == "auto":
        return "reference" if reason is None else "synthetic"
    if cache == "reference" and reason is not None:
        raise ValueError(f"{reason}; or run it with the synthetic cache (--cache synthetic)")
    return cache


def build_cache(
    spec: ModelSpec, *, cache: str, seed: int, device: str | torch.device
) -> ReferenceModel | SyntheticCache:
    """The cache `choose_cache(spec, cache)` names, seeded and on `device`."""
    if choose_cache(spec, cache) == "reference":
        return ReferenceModel(spec, seed=seed, device=device)
    return SyntheticCache(spec, seed=seed, device=device)
