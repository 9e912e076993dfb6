"""Colocated re-generation of a sample of PD outputs: the main job's correctness check."""

from __future__ import annotations

from distpool.memory.arena_pool import build_pool
from distpool.memory.sizing import GIB, size_pools
from distpool.model_impl.select import build_cache
from distpool.serving.deployment import DeploymentSpec
from distpool.serving.outcome import Outcome
from distpool.serving.workload import Request
from distpool.worker.config import WorkerConfig


def colocated_tokens(spec: DeploymentSpec, requests: list[Request]) -> dict[str, list[int]]:
    """Tokens for `requests` from one colocated pool and the same seeded model or synthetic cache."""
    worker = spec.worker
    model = build_cache(worker.spec, cache=worker.cache, seed=worker.seed, device="cpu")
    pool = build_pool(_colocated_sizes(worker), "cpu")
    out: dict[str, list[int]] = {}
    for req in requests:  # one at a time: a sample is small and this keeps the pool need minimal
        out[req.request_id] = list(model.generate(pool, [req.prompt], req.max_new_tokens)[0])
    return out


def _colocated_sizes(worker: WorkerConfig):
    """A pool for one request at a time: the worker's budget, capped at 1 GiB beside the workers
    when that still holds one request at full context."""
    args = worker.for_role(None)
    if worker.budget_bytes > GIB:
        try:
            sizes = size_pools(worker.spec, args, GIB)
        except ValueError:  # 1 GiB cannot hold one request of this model
            sizes = None
        if sizes is not None and sizes.requests_at_full_context >= 1:  # every request is within context_len
            return sizes
    return size_pools(worker.spec, args, worker.budget_bytes)


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
