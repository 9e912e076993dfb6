"""The main job's correctness check: a sample of PD outputs against an oracle.

The oracle runs each
request with the parameters and the seed it was served with. It is, per implementation:
transformers' own `generate` for the transformers runner's greedy requests (same weights, one prompt
at a time, its own cache: none of our code; its tokens cut at the first EOS or stop id, as the
served request ends there); a colocated pool and the same seeded model for the reference model, the
synthetic cache and the runner's sampled requests (or those with min_tokens): generate draws its
samples otherwise than we do, so our colocated path is their oracle. Where a served token differs,
the oracle's top-2 logit margin at that step decides: below `NEAR_TIE_MARGIN` the two computations
merely rounded a near tie differently (`near_ties`, the margin in the note); otherwise it is a
mismatch. Only the first differing step counts: after it the two sequences continue from different
tokens. The synthetic cache has no logits, so every difference of its is a mismatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace

from distpool.memory.arena_pool import build_pool
from distpool.memory.sizing import BudgetTooSmall, PoolSizes, size_pools
from distpool.model.sampling import truncated
from distpool.model_impl.select import build_model_impl
from distpool.serving.deploy import DeploymentSpec
from distpool.serving.outcome import Outcome
from distpool.serving.workloads import Request
from distpool.worker.config import WorkerConfig

NEAR_TIE_MARGIN = 1e-4  # logits: an oracle this unsure between its top two tokens is a near tie


@dataclass(frozen=True)
class Expected:
    """The oracle's tokens for one request, and its top-2 logit margin at a step (None: unknown)."""

    tokens: list[int]
    margin_at: Callable[[int], float | None]


@dataclass(frozen=True)
class Parity:
    """What the check found over the requests it re-generated."""

    checked: int = 0
    mismatches: int = 0
    near_ties: int = 0
    notes: tuple[str, ...] = ()  # one line per request that differed


def compare(request_id: str, served: list[int], expected: Expected) -> tuple[str, str | None]:
    """("equal" | "near_tie" | "mismatch", a note naming the first differing step)."""
    pairs = zip(served, expected.tokens, strict=False)  # a length difference is judged below
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    if first is None:
        if len(served) == len(expected.tokens):
            return "equal", None
        return (
            "mismatch",
            f"parity: {request_id}: {len(served)} tokens served, {len(expected.tokens)} expected",
        )
    margin = expected.margin_at(first)
    what = f"parity: {request_id}: token {first} is {served[first]}, the oracle's {expected.tokens[first]}"
    if margin is not None and margin < NEAR_TIE_MARGIN:
        return "near_tie", f"{what}: a near tie (the oracle's top-2 logit margin {margin:.2e})"
    return "mismatch", what + ("" if margin is None else f" (its top-2 logit margin {margin:.2e})")


def _transformers_expected(worker: WorkerConfig, requests: list[Request]) -> dict[str, Expected]:
    from distpool.model_impl.hf.oracle import greedy_generate, load_oracle  # imports transformers

    if worker.hf is None:
        raise ValueError("the transformers oracle needs the worker's transformers source (worker.hf)")
    model = load_oracle(worker.hf, seed=worker.seed)
    out = {}
    for req in requests:
        found = greedy_generate(model, req.prompt, req.max_new_tokens)
        # generate runs to max_tokens: the served request ends at its first EOS or stop id
        tokens = truncated(req.params, worker.eos_token_ids, found.tokens)
        out[req.request_id] = Expected(tokens=tokens, margin_at=found.margins.__getitem__)
    return out


def colocated_tokens(spec: DeploymentSpec, requests: list[Request]) -> dict[str, list[int]]:
    """Tokens for `requests` from one colocated pool and the same seeded model or synthetic cache
    (the same parameters, seeds and EOS ids; a request without a seed: the one a server at seed 0
    draws for it)."""
    requests = [replace(r, params=r.params.with_seed(0, r.request_id)) for r in requests]
    return {rid: e.tokens for rid, e in _colocated_expected(spec.worker, requests).items()}


def _colocated_expected(worker: WorkerConfig, requests: list[Request]) -> dict[str, Expected]:
    model = build_model_impl(
        worker.spec, model_impl=worker.model_impl, seed=worker.seed, device="cpu", hf=worker.hf
    )
    longest = max((len(r.prompt) + r.max_new_tokens for r in requests), default=1)
    pool = build_pool(parity_pool_sizes(worker, longest), "cpu")
    logits = getattr(model, "next_token_logits", None)  # the reference model's; the synthetic cache has none
    out = {}
    for req in requests:  # one at a time: a sample is small and this keeps the pool need minimal
        generated = model.generate(
            pool, [req.prompt], params=[req.params], eos_token_ids=worker.eos_token_ids
        )
        tokens = list(generated[0])

        def margin_at(step: int, prompt: list[int] = req.prompt, tokens: list[int] = tokens) -> float | None:
            if logits is None:
                return None
            top = logits(prompt + tokens[:step]).topk(2).values
            return float(top[0] - top[1])

        # The near-tie rule is greedy's: a sampled token has no margin to excuse it.
        out[req.request_id] = Expected(
            tokens=tokens, margin_at=margin_at if req.params.greedy else _no_margin
        )
    return out


def _no_margin(step: int) -> float | None:
    return None


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
        except BudgetTooSmall:  # a static split that cannot hold one request yet
            budget *= 2
    return size_pools(worker.spec, args, worker.budget_bytes)


def check_parity(
    spec: DeploymentSpec, requests: list[Request], outcomes: list[Outcome], sample: int
) -> Parity:
    """The first `sample` completed requests of `requests`, re-generated by the oracle."""
    done = {o.request_id: o.tokens for o in outcomes if o.tokens is not None}
    chosen = [r for r in requests if r.request_id in done][: max(sample, 0)]
    if not chosen:
        return Parity()
    # Served as they were: the same parameters and the seed each was served with.
    seeds = {o.request_id: o.seed for o in outcomes}
    chosen = [replace(r, params=replace(r.params, seed=seeds[r.request_id])) for r in chosen]
    # transformers' generate is the runner's oracle where it picks as we do (greedy, nothing banned);
    # else our colocated path is.
    by_generate = [
        r
        for r in chosen
        if spec.worker.model_impl == "transformers" and r.params.greedy and not r.params.min_tokens
    ]
    expected = _transformers_expected(spec.worker, by_generate) if by_generate else {}
    others = [r for r in chosen if r.request_id not in expected]
    if others:
        expected |= _colocated_expected(spec.worker, others)
    verdicts = [compare(r.request_id, done[r.request_id], expected[r.request_id]) for r in chosen]
    return Parity(
        checked=len(chosen),
        mismatches=sum(kind == "mismatch" for kind, _ in verdicts),
        near_ties=sum(kind == "near_tie" for kind, _ in verdicts),
        notes=tuple(note for _, note in verdicts if note is not None),
    )
