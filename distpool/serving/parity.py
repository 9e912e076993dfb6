"""Colocated re-generation of a sample of PD outputs: the main job's correctness check."""

from __future__ import annotations

import dataclasses

from distpool.memory.arena_pool import build_pool
from distpool.memory.sizing import PoolSizes, size_pools
from distpool.model_impl.select import build_cache
from distpool.serving.deployment import DeploymentSpec
from distpool.serving.outcome import Outcome
from distpool.serving.workload import Request
from distpool.worker.config import WorkerConfig


def colocated_tokens(spec: DeploymentSpec, requests: list[Request]) -> dict[str, list[int]]:
    """Tokens for `requests` from one colocated pool and the same seeded model or synthetic cache."""
    worker = spec.worker
    model = build_cache(worker.spec, cache=worker.cache, seed=worker.seed, device="cpu")
    longest = max((len(r.prompt) + r.max_new_tokens for r in requests), default=1)
    pool = build_pool(parity_pool_sizes(worker, longest), "cpu")
    out: dict[str, list[int]] = {}
    for req in requests:  # one at a time: a sample is small and this keeps the pool need minimal
        out[req.request_id] = list(model.generate(pool, [req.prompt], req.max_new_tokens)[0])
    return out


def parity_pool_sizes(worker: WorkerConfig, longest_tokens: int) -> PoolSizes:
    """The driver's pool for re-generating requests one at a time: the worker's kind of pool, sized
    for one request of `longest_tokens` (prompt and new tokens), not a whole worker budget (which
    doubled a run's memory for a model whose one request is most of a budget). Grows by doubling
    from one request's bytes until the sizing accepts it (a static split needs room for both
    pools), and never beyond the worker's budget."""
    args = dataclasses.replace(worker.for_role(None), context_len=longest_tokens)
    one = size_pools(worker.spec, args, 1 << 50).request_bytes_at_full_context
    budget = one
    while budget < worker.budget_bytes:
        try:
            return size_pools(worker.spec, args, budget)
        except ValueError:  # a static split that cannot hold one request yet
            budget *= 2
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
