"""Conditional disaggregation: per request, prefill on the decode worker that holds the state the prompt
extends (`DecodeWorker.local_prefill`), or take the disaggregated path.

Pure bookkeeping over worker names (no Ray here). Which decode worker keeps which final state (every
completed request's prompt and reply but its last token; a later turn of the same conversation
supersedes the earlier one there) is the router's view of its cache, which each worker's reports
keep equal to its own (`Router.views`); the policy decides by a cost model (README,
"Conditional disaggregation"), for a prompt with N new tokens past the state, Q more already queued
for local prefill on that worker:

    local_s  = decode_s(Q) + decode_s(N) + local admission              its TTFT prefilled on decode
    remote_s = prefill_s(N) + (slot + N's pages) / link rate + landing   its TTFT moved
    stall_s  = decode_s(N) - max(0, landing - local admission)    what decode's running requests
                                                  wait for it beyond what its landing costs them
    budget_s = LATENCY_BUDGET * per-token latency * max_new_tokens    what they tolerate over a reply
    local when local_s <= remote_s and (stall_s <= budget_s or nothing else is in flight there
                                        or no local prefill has measured decode_s yet)

Both paths stall decode's batch: a local prefill by its state copy and its chunks (each runs under
the worker's lock between two decode steps), a moved envelope by its landing (the loop puts
verification off while transfers land, then checks every byte with the batch waiting). A locally
prefilled envelope is verified alike at admission, which also spans the batch's step after its
last chunk: admission is credited where a landing took longer, never charged. So the budget bounds
only what the local path costs the batch beyond the landing it saves; a short reply's small budget
does not send a turn through prefill that is faster here.

Everything is measured from the run's own completed requests (newest weighted most): the link rate,
the per-token latency, admission per path (landed to verified and in the batch: decode's
`admit_s`), and two lines, seconds = a fixed part + a part per token: `prefill_s`, the TTFT's
prefill part (batching and waiting included) over the tokens prefill computed, and `decode_s`,
decode's seconds for a local prefill's new tokens (`compute_s`: its state copy and chunks, the
decode steps between them aside). Until a local prefill completed, prefill's model rate (its
waves' tokens over the model call's seconds, `PrefillSent.compute_tokens_per_s`) stands in for
`decode_s`, and until the samples of `decode_s` or `prefill_s` tell their two parts apart it is
their part per token; the landing stands in for local admission (the same envelope verified).
The stand-in decides a turn's TTFT, not its stall: the budget applies once a local prefill has
measured what decode's chunks cost (the synthetic prefill's model rate read a 338-token turn as
0.17 to 0.34 s of stall where decode took 0.07 s, and sent second turns remote under load).
Until all of them have been measured, every request takes the disaggregated path. `max_tokens`
replaces the model with a fixed bound on N + Q.
A worker whose load exceeds the least loaded one's by more than `router.AFFINITY_SLACK` is not asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from distpool.serving.routing.router import AFFINITY_SLACK, Router

# Running requests' per-token latency may grow by this fraction over a reply's length for what a local
# prefill stalls them beyond what its envelope's landing would (the benchmark's target: p99 at most 1.5x).
LATENCY_BUDGET = 0.5
SMOOTHING = 0.2  # weight of the newest measurement in each moving average


@dataclass(frozen=True)
class ConditionalOptions:
    """`--local-prefill-max-tokens` (None: the cost model decides). Whether local prefill happens
    at all is the workers' `WorkerConfig.local_prefill`: decode keeps final states only then."""

    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--local-prefill-max-tokens must be at least 1 token; got {self.max_tokens}")


@dataclass(frozen=True)
class Sizes:
    """What one request moves on the disaggregated path: its slot and its pages, in bytes."""

    slot_bytes: int
    page_bytes: int
    page_size: int


class _Average:
    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - SMOOTHING) * self.value + SMOOTHING * sample


class _Line:
    """y = fixed + per_x * x, both parts at least 0, fitted by least squares over (x, y) samples,
    newest weighted most. Until the samples' x spread enough to tell the parts apart, `per_x_hint`
    (when given) is the part per x and the samples give the fixed part; else a line through the
    origin (a rate)."""

    def __init__(self) -> None:
        self.x, self.y, self.xx, self.xy = _Average(), _Average(), _Average(), _Average()

    def add(self, x: float, y: float) -> None:
        for average, sample in ((self.x, x), (self.y, y), (self.xx, x * x), (self.xy, x * y)):
            average.add(sample)

    def at(self, x: float, per_x_hint: float | None = None) -> float | None:
        if self.x.value is None:
            return None
        mean_x, mean_y, xx, xy = self.x.value, self.y.value, self.xx.value, self.xy.value
        if mean_y is None or xx is None or xy is None:  # set together with x: never apart
            return None
        spread = xx - mean_x * mean_x
        if spread > (0.01 * mean_x) ** 2:  # x's standard deviation at least 1% of its mean
            per_x = (xy - mean_x * mean_y) / spread
            if per_x <= 0:  # no cost per x to be seen: the mean, flat
                return mean_y
        else:
            per_x = per_x_hint if per_x_hint is not None else 0.0
        fixed = mean_y - per_x * mean_x
        if per_x > 0 and fixed >= 0:
            return fixed + per_x * x
        return xy / xx * x  # through the origin


@dataclass(frozen=True)
class Estimate:
    """The cost model's figures for one request, in seconds (see the module's docstring)."""

    local_s: float  # its TTFT prefilled on decode: what is queued there, its own tokens, admission
    remote_s: float  # its TTFT on the disaggregated path: prefill, the move, the landing
    stall_s: float  # what decode's running requests wait for it beyond what its landing costs them
    budget_s: float  # what they tolerate over a reply
    stall_measured: bool = True  # False: decode_s is prefill's model rate standing in

    def local(self, batch_running: bool) -> bool:
        """Whether to prefill it on decode, `batch_running`: other requests are on that worker."""
        bounded = self.stall_measured and batch_running
        return self.local_s <= self.remote_s and (self.stall_s <= self.budget_s or not bounded)


class LocalPrefillPolicy:
    def __init__(self, router: Router, sizes: Sizes, options: ConditionalOptions) -> None:
        self.router, self.sizes, self.options = router, sizes, options
        self.queued_tokens: dict[str, int] = dict.fromkeys(router.decode_names, 0)  # local, in flight
        self.link_bytes_per_s, self.tpot_s = _Average(), _Average()
        self.prefill_s = _Line()  # the remote path's prefill part for x prompt tokens, waiting included
        self.decode_s = _Line()  # decode's seconds for a local prefill of x new tokens
        # Prefill's model rate, waiting aside: what stands in for `decode_s` until a local prefill completed.
        self.model_tokens_per_s = _Average()
        self.admit_s = {"remote": _Average(), "local": _Average()}  # landed -> verified, in the batch

    # ---- what the run measured -----------------------------------------------------------------
    def measured(
        self,
        *,
        transfer_bytes: int,
        transfer_s: float,
        computed_tokens: int,
        prefill_s: float,
        tpot_s: float | None,
        compute_tokens_per_s: float = 0.0,
        landing_s: float | None = None,
    ) -> None:
        """One completed request's figures (transfer, prefill and `landing_s`, its envelope landed to
        verified and in the batch: the disaggregated path's)."""
        if compute_tokens_per_s > 0:
            self.model_tokens_per_s.add(compute_tokens_per_s)
        if transfer_bytes and transfer_s > 0:
            self.link_bytes_per_s.add(transfer_bytes / transfer_s)
        if computed_tokens and prefill_s > 0:
            self.prefill_s.add(computed_tokens, prefill_s)
        if tpot_s is not None and tpot_s > 0:
            self.tpot_s.add(tpot_s)
        if landing_s is not None and landing_s >= 0:
            self.admit_s["remote"].add(landing_s)

    def measured_locally(self, computed_tokens: int, compute_s: float, admit_s: float | None = None) -> None:
        """A local prefill's new tokens, decode's seconds for them (the state copy and the chunks)
        and its admission (its last chunk to verified and in the batch)."""
        if computed_tokens and compute_s > 0:
            self.decode_s.add(computed_tokens, compute_s)
        if admit_s is not None and admit_s >= 0:
            self.admit_s["local"].add(admit_s)

    def estimate(self, new_tokens: int, queued_tokens: int, max_new_tokens: int) -> Estimate | None:
        """The cost model's figures for `new_tokens` past a state held on a decode worker with
        `queued_tokens` queued for local prefill; None until the run has measured what they need."""
        link, tpot = self.link_bytes_per_s.value, self.tpot_s.value
        prefill_s = self.prefill_s.at(new_tokens, per_x_hint=self._model_s_per_token())
        landing = self.admit_s["remote"].value
        if link is None or tpot is None or prefill_s is None or landing is None:
            return None
        own_s = self._decode_s(new_tokens)
        queued_s = self._decode_s(queued_tokens) if queued_tokens else 0.0
        if own_s is None or queued_s is None:
            return None
        admit = self.admit_s["local"].value
        admit = landing if admit is None else admit  # the same envelope, verified alike
        sizes = self.sizes
        pages = -(-new_tokens // sizes.page_size) + 1  # the pages it would not hold, at most
        move_s = (sizes.slot_bytes + pages * sizes.page_bytes) / link
        return Estimate(
            local_s=queued_s + own_s + admit,
            remote_s=prefill_s + move_s + landing,
            # Admission verifies the same bytes on both paths; a local one's also spans the batch's
            # step after its last chunk, so it never counts as costing the batch more than a landing.
            stall_s=own_s - max(0.0, landing - admit),
            budget_s=LATENCY_BUDGET * tpot * max_new_tokens,
            stall_measured=self.decode_s.x.value is not None,
        )

    def _model_s_per_token(self) -> float | None:
        model = self.model_tokens_per_s.value
        return None if model is None else 1 / model

    def _decode_s(self, tokens: int) -> float | None:
        """Decode's seconds for a local prefill of `tokens`. Until its samples tell the parts apart,
        prefill's model computes the part per token (one local prefill of a few tokens is mostly
        the fixed part: read as a rate, it made a queue of long ones look 5x slower than it was)."""
        per_token = self._model_s_per_token()
        fitted = self.decode_s.at(tokens, per_x_hint=per_token)
        if fitted is not None:
            return fitted
        return None if per_token is None else tokens * per_token

    def allows(
        self, new_tokens: int, queued_tokens: int, max_new_tokens: int, *, batch_running: bool = True
    ) -> bool:
        """Whether a decode worker with `queued_tokens` already queued for local prefill (and other
        requests on it: `batch_running`) may compute `new_tokens` more for a request replying up to
        `max_new_tokens` (the cost model, or the flag)."""
        if self.options.max_tokens is not None:
            return new_tokens + queued_tokens <= self.options.max_tokens
        estimate = self.estimate(new_tokens, queued_tokens, max_new_tokens)
        return estimate is not None and estimate.local(batch_running)

    # ---- which worker holds what -----------------------------------------------------------------
    def choose(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        avoid: set[str],
        keys: Sequence[bytes] | None = None,
    ) -> tuple[str, int] | None:
        """(the decode worker to prefill `prompt` on, the tokens it holds), or None: disaggregated.
        `keys`: the prompt's `chained_block_keys` in the decode pools' blocks, if known."""
        live = [n for n in self.router.alive(self.router.decode_names) if n not in avoid]
        if not live:
            return None
        best: tuple[str, int] | None = None
        views = self.router.views
        chain = views[live[0]].state_chain(prompt, keys)  # every view has the same block
        for name in live:
            held = views[name].longest_state(prompt, chain)
            if held is not None and (best is None or held > best[1]):
                best = (name, held)
        if best is None:
            return None
        name, held = best
        new_tokens = len(prompt) - held
        least = min(self.router.in_flight[n] for n in live)
        if self.router.in_flight[name] - least > AFFINITY_SLACK:
            return None
        busy = self.router.in_flight[name] > 0  # other requests there: a batch its prefill stalls
        if not self.allows(new_tokens, self.queued_tokens[name], max_new_tokens, batch_running=busy):
            return None
        return best
