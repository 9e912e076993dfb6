"""The driver's side of a local prefill (`DecodeWorker.local_prefill`): one attempt on the decode worker
holding the state the prompt extends, chosen by `serving.routing.conditional` (`LocalPath`), or, in a
colocated deployment (`--prefill 0`), on a decode worker for every request (`ColocatedPath`).
Nothing is transferred; the result arrives through that worker's `next_finished` stream like any
other."""

from __future__ import annotations

import time

from distpool.memory.sizing import size_pools
from distpool.serving.deploy import Deployment
from distpool.serving.outcome import Outcome
from distpool.serving.path.attempt_errors import Busy
from distpool.serving.path.attempts import Attempts
from distpool.serving.routing import ConditionalOptions, LocalPrefillPolicy, Router, Sizes
from distpool.serving.workloads import Request
from distpool.worker.messages import DecodeFailed, DecodeResult, LocalPrefillRefused, Refusal, ViewedState


class LocalPath:
    """The local attempts of one `Server`, where `policy` chooses them; each is opened in `attempts`,
    which owns it and the calls it makes."""

    def __init__(self, deployment: Deployment, policy: LocalPrefillPolicy, attempts: Attempts) -> None:
        self.deployment, self.policy, self.router = deployment, policy, policy.router
        self.attempts = attempts

    @classmethod
    def build(
        cls,
        deployment: Deployment,
        router: Router,
        options: ConditionalOptions,
        attempts: Attempts,
    ) -> LocalPath | None:
        """The local path when it can happen: decode keeps final states (local prefill on, a prefix
        cache, and a model with recurrent state and KV pages) on one rank; else None. A decode worker
        of TP > 1 prefills nothing itself: every request takes the disaggregated path. A colocated
        deployment (`DeploymentSpec.colocated`, checked to have what this needs) serves every
        request here."""
        worker = deployment.spec.worker
        if deployment.spec.colocated:
            return ColocatedPath(deployment, router, attempts)
        if not (worker.local_prefill and worker.pool_args.prefix_cache) or worker.decode_tp > 1:
            return None
        sizes = size_pools(worker.spec, worker.for_role("decode"), worker.budget_bytes)
        if not (sizes.slot_bytes and sizes.page_bytes):
            return None
        policy = LocalPrefillPolicy(
            router, Sizes(sizes.slot_bytes, sizes.page_bytes, sizes.page_size), options
        )
        return cls(deployment, policy, attempts)

    def record(self, out: Outcome) -> None:
        """A completed request's figures, for the cost model (a local one's costs: `attempt`)."""
        if out.tokens is None:
            raise ValueError(f"request {out.request_id} did not complete: it has no figures to record")
        remote = out.path == "remote"
        self.policy.measured(
            transfer_bytes=out.transfer_bytes,
            transfer_s=out.transfer_s,
            computed_tokens=out.prefill_tokens_computed,
            prefill_s=out.prefill_s if remote else 0.0,
            compute_tokens_per_s=out.prefill_compute_tokens_per_s,
            tpot_s=out.decode_s / (len(out.tokens) - 1) if len(out.tokens) > 1 else None,
            landing_s=out.first_token_s if remote else None,
        )

    async def attempt(
        self, req: Request, out: Outcome, submitted: float, avoid: set[str]
    ) -> DecodeResult | None:
        """Prefill `req` on the decode worker holding its state, if the policy says so: its result
        (filled into `out` when it finished), or None (not chosen, or refused holding nothing): the
        disaggregated path serves it. A failure there puts that worker in `avoid`."""
        keys = req.block_keys(self.policy.router.page_size)
        chosen = self.policy.choose(req.prompt, req.max_new_tokens, avoid, keys)
        if chosen is None:
            return None
        decode_name, held = chosen
        new_tokens = len(req.prompt) - held
        self.policy.queued_tokens[decode_name] += new_tokens
        viewed = ViewedState(held_tokens=held, report=self.router.views[decode_name].report)
        try:
            result = await self.prefill_on(decode_name, req, out, submitted, avoid, viewed=viewed)
        finally:
            self.policy.queued_tokens[decode_name] -= new_tokens
        if isinstance(result, LocalPrefillRefused):
            out.local_refused += 1
            out.stale_view_refusals += result.kind is Refusal.NO_STATE  # the view said it kept one
            out.refusals_news_in_flight += result.kind is Refusal.NEWS_IN_FLIGHT  # its drop unheard yet
            return None
        if not isinstance(result, DecodeFailed):
            self.policy.measured_locally(result.local_computed_tokens, result.local_compute_s, result.admit_s)
        return result

    async def prefill_on(
        self,
        decode_name: str,
        req: Request,
        out: Outcome,
        submitted: float,
        avoid: set[str],
        *,
        fresh: bool = False,
        viewed: ViewedState | None = None,
    ) -> DecodeResult | LocalPrefillRefused:
        """Ask `decode_name` to prefill `req` itself (`fresh`: from nothing where it keeps no state the
        prompt extends) and wait for its result, filled into `out` when it finished; or its refusal
        (it holds nothing). A failure there puts that worker in `avoid`."""
        rid = req.request_id
        self.router.begin(decode_name)
        began = time.monotonic()
        handle = self.deployment.decode[decode_name]
        try:
            with self.attempts.open(rid, decode_name) as attempt:
                try:
                    asked = handle.local_prefill.remote(
                        rid, req.prompt, req.params, fresh=fresh, viewed=viewed
                    )
                    answer = await self.attempts.call(decode_name, asked)
                    if isinstance(answer, LocalPrefillRefused):
                        attempt.refused = True
                        return answer
                    result = await self.attempts.result(attempt, handle)
                    if isinstance(result, DecodeFailed):
                        avoid.add(decode_name)
                    else:
                        out.succeeded_locally(len(req.prompt), result, decode_name, (submitted, began))
                    return result
                except BaseException:
                    avoid.add(decode_name)
                    await self.attempts.quiet(handle.cancel.remote(rid))
                    raise
        finally:
            self.router.end(decode_name)


class ColocatedPath(LocalPath):
    """Every request of a colocated deployment (no prefill workers): prefilled on a decode worker,
    the one caching the longest prefix of its prompt first (where its conversation's last turn left
    its state), else the least loaded; one with no room refuses and the next is asked. None has
    room: Busy, and the request waits. Nothing is transferred."""

    def __init__(self, deployment: Deployment, router: Router, attempts: Attempts) -> None:
        self.deployment, self.router, self.attempts = deployment, router, attempts
        self.cache_affinity = deployment.spec.worker.pool_args.prefix_cache

    async def attempt(self, req: Request, out: Outcome, submitted: float, avoid: set[str]) -> DecodeResult:
        refusals = []
        keys = req.block_keys(self.router.page_size) if self.cache_affinity else None
        for name in self.router.decode_candidates(avoid, keys=keys):
            result = await self.prefill_on(name, req, out, submitted, avoid, fresh=True)
            if not isinstance(result, LocalPrefillRefused):
                return result
            refusals.append(f"{name}: {result.reason}")
        raise Busy("; ".join(refusals))

    def record(self, out: Outcome) -> None:
        """No cost model: every request takes this path."""
