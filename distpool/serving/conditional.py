"""Conditional disaggregation: per request, prefill on the decode worker that holds the state the prompt
extends (`DecodeWorker.local_prefill`), or take the disaggregated path.

Pure bookkeeping over worker names (no Ray here). The driver mirrors which decode worker kept which
final state (every completed request's prompt and reply but its last token; a later turn of the same
conversation supersedes the earlier one there too), and decides by a cost model (README,
"Conditional disaggregation"), for a prompt with N new tokens past the state, Q more already queued
for local prefill on that worker:

    local_s  = (N + Q) / decode's prefill rate                      what decode spends computing them
    remote_s = N / prefill's rate + (slot + N's pages) / link rate  what the disaggregated path spends
    budget_s = LATENCY_BUDGET * per-token latency * max_new_tokens  what running requests tolerate
    local when local_s <= min(remote_s, budget_s)

The remote path computes the same new tokens (at best: prefill's cache may not hold the prefix)
before it moves the slot, so local prefill wins whenever decode computes about as fast as prefill
does; the running batch's latency budget is what bounds it. The link rate, the rates and the
per-token latency are measured from the run's own completed requests (moving averages). Prefill's
rate is prompt tokens over the TTFT's prefill part (which includes batching and waiting, as the
remote path does); decode's is prompt tokens over the seconds its chunks took, the decode steps
between them aside. Until a local prefill completed, prefill's model rate (its waves' tokens over
the model call's seconds, `PrefillSent.compute_tokens_per_s`: the same model computing, waiting
aside) stands in for decode's. Until all of them have been measured, every request takes the
disaggregated path. `max_tokens` replaces the model with a fixed bound on N + Q.
A worker whose load exceeds the least loaded one's by more than `router.AFFINITY_SLACK` is not asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from distpool.memory.prefix_keys import PrefixKeys
from distpool.serving.router import AFFINITY_SLACK, Router

# Running requests' per-token latency may grow by this fraction over a reply's length while a local
# prefill interleaves with their steps (the benchmark's target: p99 at most 1.5x).
LATENCY_BUDGET = 0.5
SMOOTHING = 0.2  # weight of the newest measurement in each moving average
MAX_STATES_PER_WORKER = 4096  # the mirror's bound; a worker keeps at most one state per slot anyway


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


class LocalPrefillPolicy:
    def __init__(self, router: Router, sizes: Sizes, options: ConditionalOptions) -> None:
        self.router, self.sizes, self.options = router, sizes, options
        self.states: dict[str, PrefixKeys[None]] = {
            n: PrefixKeys(sizes.page_size) for n in router.decode_names
        }
        self.queued_tokens: dict[str, int] = dict.fromkeys(router.decode_names, 0)  # local, in flight
        self.link_bytes_per_s, self.tpot_s = _Average(), _Average()
        # Prompt tokens per second: the remote path's (waiting included), decode's own, and prefill's
        # model rate (waiting aside: what stands in for decode's until a local prefill completed).
        self.prefill_tokens_per_s = {"remote": _Average(), "local": _Average(), "model": _Average()}

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
    ) -> None:
        """One completed request's figures (transfer and prefill: the disaggregated path's)."""
        if compute_tokens_per_s > 0:
            self.prefill_tokens_per_s["model"].add(compute_tokens_per_s)
        if transfer_bytes and transfer_s > 0:
            self.link_bytes_per_s.add(transfer_bytes / transfer_s)
        if computed_tokens and prefill_s > 0:
            self.prefill_tokens_per_s["remote"].add(computed_tokens / prefill_s)
        if tpot_s is not None and tpot_s > 0:
            self.tpot_s.add(tpot_s)

    def measured_locally(self, computed_tokens: int, compute_s: float) -> None:
        """A local prefill's prompt tokens and the seconds its chunks took on decode."""
        if computed_tokens and compute_s > 0:
            self.prefill_tokens_per_s["local"].add(computed_tokens / compute_s)

    def allows(self, new_tokens: int, queued_tokens: int, max_new_tokens: int) -> bool:
        """Whether a decode worker with `queued_tokens` already queued for local prefill may compute
        `new_tokens` more for a request replying up to `max_new_tokens` (the cost model, or the flag)."""
        if self.options.max_tokens is not None:
            return new_tokens + queued_tokens <= self.options.max_tokens
        rates = self.prefill_tokens_per_s
        remote, local = rates["remote"].value, rates["local"].value or rates["model"].value
        link, tpot = self.link_bytes_per_s.value, self.tpot_s.value
        if link is None or remote is None or local is None or tpot is None:
            return False  # not measured yet: the disaggregated path
        sizes = self.sizes
        pages = -(-new_tokens // sizes.page_size) + 1  # the pages it would not hold, at most
        move_s = (sizes.slot_bytes + pages * sizes.page_bytes) / link
        local_s = (new_tokens + queued_tokens) / local
        remote_s = new_tokens / remote + move_s
        budget_s = LATENCY_BUDGET * tpot * max_new_tokens
        return local_s <= min(remote_s, budget_s)

    # ---- which worker holds what -----------------------------------------------------------------
    def remember(self, decode_name: str, tokens: Sequence[int]) -> None:
        """`decode_name` kept the final state after `tokens`; it supersedes the states it extends."""
        held = self.states.get(decode_name)
        if held is None or decode_name in self.router.dead or not tokens:
            return
        held.add(tokens, None)
        while len(held) > MAX_STATES_PER_WORKER:
            held.pop_oldest()

    def forget(self, decode_name: str, prompt: Sequence[int]) -> None:
        """`decode_name` refused a local prefill of `prompt`: it holds no state the prompt extends."""
        held = self.states.get(decode_name)
        for key in held.prefixes_of(prompt, proper=True) if held is not None else ():
            held.pop(key)

    def choose(self, prompt: Sequence[int], max_new_tokens: int, avoid: set[str]) -> tuple[str, int] | None:
        """(the decode worker to prefill `prompt` on, the tokens it holds), or None: disaggregated."""
        live = [n for n in self.router.alive(self.router.decode_names) if n not in avoid]
        if not live:
            return None
        best: tuple[str, int] | None = None
        for name in live:
            found = self.states[name].longest_proper_prefix(prompt)
            if found is not None and (best is None or len(found[0]) > best[1]):
                best = (name, len(found[0]))
        if best is None:
            return None
        name, held = best
        new_tokens = len(prompt) - held
        least = min(self.router.in_flight[n] for n in live)
        if self.router.in_flight[name] - least > AFFINITY_SLACK:
            return None
        if not self.allows(new_tokens, self.queued_tokens[name], max_new_tokens):
            return None
        return best
