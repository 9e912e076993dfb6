"""What became of one request (`Outcome`), and a remote error in one line (`one_line`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from distpool.model.sampling import Finish
from distpool.worker.messages import DecodeFinished, PrefillSent
from transfer.wire import FailureKind


@dataclass
class Outcome:
    request_id: str
    tokens: list[int] | None = None
    finish: Finish | None = None  # why a completed request ended: stop (which id) or length
    seed: int | None = None  # the sampling seed it was served with (its own, or drawn from the run's)
    error: str | None = None  # why it failed, for a person; with its kind:
    failure: FailureKind | None = None  # what the summary counts (`failures_by_reason`)
    attempts: int = 0
    corrupt: bool = False  # the request failed for good on bytes found wrong (at release)
    cancelled: bool = False  # cancelled by its caller (`Server.cancel`): neither served nor failed
    retried_after: list[FailureKind] = field(default_factory=list)  # each failed attempt that was retried
    verified: bool = False  # decode checked every byte of its envelope (synthetic cache)
    # TTFT = queue + reserve + prefill + transfer + first_token (the successful attempt's parts):
    queue_s: float = 0.0  # submit -> the attempt that succeeded began
    reserve_s: float = 0.0  # the decode reservation prefill waited for (0 when made while it computed)
    prefill_s: float = 0.0  # prefill call minus the transfer: batching, prefill, waiting to send
    transfer_s: float = 0.0  # the envelope's transfer: its header (or READY, if it waited) to the last byte
    first_token_s: float = 0.0  # landed on decode -> verified and in the decode batch
    decode_s: float = 0.0  # first token -> last token
    transfer_bytes: int = 0
    received_bytes: tuple[int, ...] = ()  # what its transfer wrote on each rank of the decode worker
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0  # the prompt's tokens prefill computed (after a cached prefix)
    prefill_compute_tokens_per_s: float = 0.0  # prefill's model rate in its wave (0: unknown, or local)
    decode_prefix_hit_tokens: int = 0  # the prompt's tokens decode held already (never transferred)
    source_runs: int = 0  # byte runs of the envelope at prefill
    destination_runs: int = 0  # and at decode
    pair: tuple[str, str] | None = None  # (prefill worker, decode worker) of the successful attempt
    path: str = "remote"  # remote: prefilled on a prefill worker and transferred; local: on decode
    local_refused: int = 0  # local prefills decode refused (state gone, no room): then disaggregated
    # Of which decode kept no state the prompt extends although the driver's view of its cache said
    # it did: on a stale view (decode had reported the state gone before the driver chose: 0 unless
    # the view is broken), or on news in flight (its report had not reached the driver yet).
    stale_view_refusals: int = 0
    refusals_news_in_flight: int = 0

    def succeeded(
        self,
        prompt_len: int,
        sent: PrefillSent,
        result: DecodeFinished,
        pair: tuple[str, str],
        times: tuple[float, float, float, float],
    ) -> None:
        """Fill in a successful attempt from prefill's `sent` and decode's `result` (their workers'
        reports) and the driver's monotonic `times`: submitted, the attempt began, prefill asked, sent."""
        submitted, began, prefill_asked, sent_at = times
        self.queue_s, self.reserve_s = began - submitted, prefill_asked - began
        self.transfer_bytes, self.transfer_s = sent.transfer_bytes, sent.transfer_s
        self.prompt_tokens = prompt_len
        self.prefill_tokens_computed = sent.computed_tokens
        self.prefill_compute_tokens_per_s = sent.compute_tokens_per_s
        self.prefill_s = max(0.0, sent_at - prefill_asked - self.transfer_s)
        self.first_token_s = result.admit_s
        self.source_runs, self.destination_runs = sent.source_runs, result.destination_runs
        self.decode_prefix_hit_tokens = result.prefix_hit_tokens
        self.verified, self.received_bytes = result.verified, result.received_bytes
        self.pair = pair
        self.tokens, self.decode_s, self.error, self.failure = result.tokens, result.decode_s, None, None
        self.finish = result.finish

    def succeeded_locally(
        self, prompt_len: int, result: DecodeFinished, decode_name: str, times: tuple[float, float]
    ) -> None:
        """Fill in an attempt prefilled on decode worker `decode_name` (from a kept state, or from
        nothing when colocated): its prefill part is decode's (accepted to its last chunk); nothing
        moved. `times`: submitted, began."""
        submitted, began = times
        self.queue_s, self.reserve_s, self.transfer_s, self.transfer_bytes = began - submitted, 0.0, 0.0, 0
        self.prompt_tokens, self.prefill_tokens_computed = prompt_len, result.local_computed_tokens
        self.prefill_compute_tokens_per_s = 0.0
        self.prefill_s, self.first_token_s = result.local_prefill_s, result.admit_s
        self.source_runs, self.destination_runs = 0, 0
        self.decode_prefix_hit_tokens = result.prefix_hit_tokens
        self.verified, self.pair, self.path = result.verified, None, "local"  # no pair: nothing moved
        self.received_bytes = ()
        self.tokens, self.decode_s, self.error, self.failure = result.tokens, result.decode_s, None, None
        self.finish = result.finish

    @property
    def ttft_s(self) -> float:
        """Submit -> the first token is on the decode worker, the envelope verified."""
        return self.queue_s + self.reserve_s + self.prefill_s + self.transfer_s + self.first_token_s


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def one_line(exc: BaseException) -> str:
    """`Type: reason` on one line: a remote error's cause without Ray's traceback or colour codes."""
    cause = getattr(exc, "cause", None) or exc
    lines = [line.strip() for line in _ANSI.sub("", str(cause)).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"[:300]
