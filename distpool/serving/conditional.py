"""Conditional disaggregation: per request, prefill on the decode worker that holds the state the prompt
extends (`DecodeWorker.local_prefill`), or take the disaggregated path.

Pure bookkeeping over worker names (no Ray here). The driver mirrors which decode worker kept which
final state (every completed request's prompt and reply but its last token; a later turn of the same
conversation supersedes the earlier one there too), and decides by a cost model (README,
"Conditional disaggregation"):

    move_s   = (slot_bytes + unmatched pages * page_bytes) / link rate   what the transfer would cost
    budget_s = LATENCY_BUDGET * per-token latency * max_new_tokens        what running requests tolerate
    local when new tokens + tokens queued for local prefill there <= prefill rate * min(move_s, budget_s)

The link rate, the prefill rate and the per-token latency are measured from the run's own completed
requests (moving averages). The prefill rate is decode's own (prompt tokens over the seconds its
chunks took, the decode steps between them aside) once a local prefill completed, and until then
prefill's (prompt tokens over the TTFT's prefill part, a pessimistic prior: it includes batching
and waiting). Until all three have been measured, every request takes the disaggregated path; until
decode's rate has been, one local prefill at a time may go past the model's figure to measure it.
`max_tokens` replaces the model's figure with a fixed one.
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
    """`--conditional-disagg` and `--local-prefill-max-tokens` (None: the cost model's figure)."""

    enabled: bool = True  # on by default: the README's benchmark says why
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
        self.prefill_tokens_per_s = {"remote": _Average(), "local": _Average()}  # by path

    # ---- what the run measured -----------------------------------------------------------------
    def measured(
        self,
        *,
        transfer_bytes: int,
        transfer_s: float,
        computed_tokens: int,
        prefill_s: float,
        tpot_s: float | None,
    ) -> None:
        """One completed request's figures (transfer and prefill: the disaggregated path's)."""
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

    def max_tokens(self, new_tokens: int, max_new_tokens: int) -> int:
        """Prompt tokens a decode worker may compute for one request (the cost model, or the flag)."""
        if self.options.max_tokens is not None:
            return self.options.max_tokens
        rates = self.prefill_tokens_per_s
        rate = rates["local"].value if rates["local"].value is not None else rates["remote"].value
        link, tpot = self.link_bytes_per_s.value, self.tpot_s.value
        if link is None or rate is None or tpot is None:
            return 0  # nothing measured yet: the disaggregated path
        sizes = self.sizes
        pages = -(-new_tokens // sizes.page_size) + 1  # the pages it would not hold, at most
        move_s = (sizes.slot_bytes + pages * sizes.page_bytes) / link
        budget_s = LATENCY_BUDGET * tpot * max_new_tokens
        return int(rate * min(move_s, budget_s))

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
        if not self.options.enabled:
            return None
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
        limit = self.max_tokens(new_tokens, max_new_tokens)
        if limit and self._exploring():
            return best  # decode's own rate is still unknown: measure it with this one
        if new_tokens + self.queued_tokens[name] > limit:
            return None
        return best

    def _exploring(self) -> bool:
        """Whether a local prefill may go past the figure to measure decode's rate: none has
        completed and none is in flight, and the figure is the cost model's."""
        unmeasured = self.prefill_tokens_per_s["local"].value is None
        return self.options.max_tokens is None and unmeasured and not any(self.queued_tokens.values())
