"""Colocated re-generation of a sample of PD outputs: the main job's correctness check."""

from __future__ import annotations

import dataclasses

from distpool.launcher import DeploymentSpec
from distpool.serve import Outcome, Request


def colocated_tokens(spec: DeploymentSpec, requests: list[Request]) -> dict[str, list[int]]:
    """Greedy tokens for `requests` from one colocated pool and the same seeded reference model."""
    from distpool.configurator import plan
    from distpool.pools import build_pool
    from distpool.reference_model import ReferenceModel

    model = ReferenceModel(spec.model_config, seed=spec.seed, device="cpu")
    args = dataclasses.replace(spec.resolved_pool_args(model.spec), disaggregation_mode=None)
    pool = build_pool(plan(model.spec, args, spec.budget_bytes), "cpu")
    out: dict[str, list[int]] = {}
    for req in requests:  # one at a time: a sample is small and this keeps the pool need minimal
        out[req.request_id] = list(model.generate(pool, [req.prompt], req.max_new_tokens)[0])
    return out


def check_parity(
    spec: DeploymentSpec, requests: list[Request], outcomes: list[Outcome], sample: int
) -> tuple[int, int]:
    """(checked, mismatches) over the first `sample` completed requests."""
    done = {o.request_id: o.tokens for o in outcomes if o.tokens is not None}
    chosen = [r for r in requests if r.request_id in done][: max(sample, 0)]
    if not chosen:
        return 0, 0
    expected = colocated_tokens(spec, chosen)
    mismatches = sum(expected[r.request_id] != done[r.request_id] for r in chosen)
    return len(chosen), mismatches
