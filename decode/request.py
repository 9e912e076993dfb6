"""What the decode worker keeps of one request, from its reservation until its result is handed out."""

from __future__ import annotations

from dataclasses import dataclass, field

from distpool.model.sampling import LENGTH, Finish, SamplingParams, finish_after
from distpool.worker.messages import DecodeFailed, DecodeFinished, DecodeResult
from transfer import FailureKind, Parts, Transfer


@dataclass
class DecodeRequest:
    prompt: list[int]
    params: SamplingParams  # how it generates and when it ends (distpool.model.sampling)
    tokens: list[int] = field(default_factory=list)  # generated so far (the first comes from prefill)
    held_tokens: int = 0  # of the prompt, in cached pages held here already (never transferred)
    runs: int = 0  # byte runs the transfer writes into
    landed_at: float = 0.0
    admitted_at: float = 0.0
    finished_at: float = 0.0
    transfers: list[Transfer] = field(default_factory=list)  # one per channel from the prefill's ranks
    parts: Parts | None = None  # the transfers joined, once every one was expected
    received_bytes: int = 0  # what its transfers wrote here
    error: str | None = None  # set when decode gave it up after receiving it, with its kind:
    failure: FailureKind | None = None  # CORRUPT: its bytes failed verification
    retry: bool = True  # whether another pair may succeed (False: a bug here, e.g. the decode loop raised)
    verified: bool = False  # its bytes were checked on arrival (and are again at release)
    local: bool = False  # prefilled here from a kept final state (local_prefill.py), never transferred
    prefilled: int = 0  # local: prompt tokens whose KV and state the envelope holds so far
    accepted_at: float = 0.0  # local: when its prefill here was accepted (its state copy began)
    compute_s: float = 0.0  # local: seconds its state copy and its chunks took (decode steps aside)
    finish: Finish | None = None  # why it ended, once it did
    streamed: int = 0  # tokens handed out by `next_events` while it ran (streaming)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_tokens

    def streamable(self, eos_token_ids: tuple[int, ...]) -> list[int]:
        """Its tokens a client may see while it runs: those made so far, or before its envelope
        lands the first token its transfer header carried; none while the last of them ends it (an
        EOS or stop id, or its max_tokens: they come with its result, as the tokens that ended it)."""
        tokens = self.tokens
        if not tokens and self.transfers and self.transfers[0].first_token is not None:
            tokens = [int(self.transfers[0].first_token)]
        return tokens if tokens and finish_after(self.params, eos_token_ids, tokens) is None else []

    def unstreamed(self, eos_token_ids: tuple[int, ...]) -> tuple[int, list[int]] | None:
        """Its `streamable` tokens not yet handed out, with the index of the first (now counted as
        handed out); None when there are none."""
        tokens = self.streamable(eos_token_ids)
        if len(tokens) <= self.streamed:
            return None
        start, self.streamed = self.streamed, len(tokens)
        return start, tokens[start:]

    def result(self) -> DecodeResult:
        """What `next_finished` hands out for this request once it finished or failed."""
        if self.error is not None:
            if self.failure is None:
                raise ValueError(f"a request given up ({self.error}) without a kind of failure")
            return DecodeFailed(kind=self.failure, reason=self.error, retry=self.retry)
        return DecodeFinished(
            tokens=self.tokens,
            finish=self.finish or LENGTH,
            decode_s=self.finished_at - self.admitted_at,
            admit_s=self.admitted_at - self.landed_at,
            destination_runs=self.runs,
            prefix_hit_tokens=self.held_tokens,
            verified=self.verified,
            received_bytes=() if self.local else (self.received_bytes,),
            local_computed_tokens=self.prompt_len - self.held_tokens if self.local else 0,
            local_prefill_s=self.landed_at - self.accepted_at if self.local else 0.0,
            local_compute_s=self.compute_s,
        )


def check_request(
    request_id: str, prompt: object, params: SamplingParams, vocab_size: int, context_len: int
) -> None:
    """Raise ValueError (with the fix) unless `prompt` is a non-empty list of token ids in the
    vocabulary and the request fits the context length once it has all its new tokens."""
    if not isinstance(prompt, list) or not all(type(t) is int and 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"the prompt of {request_id!r} must be a list of token ids in [0, {vocab_size})")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"request {request_id!r} needs its SamplingParams, got {type(params).__name__}")
    if not params.greedy and params.seed is None:
        raise ValueError(
            f"request {request_id!r} samples without a seed; the server sets one where it enters"
        )
    max_new_tokens = params.max_tokens
    if len(prompt) < 1 or max_new_tokens < 1:
        raise ValueError(f"prompt_len and max_new_tokens must be >= 1; got {len(prompt)}, {max_new_tokens}")
    if len(prompt) + max_new_tokens > context_len:
        raise ValueError(
            f"request {request_id!r} needs {len(prompt) + max_new_tokens} tokens, more than the pool's "
            f"context length {context_len}; raise --context-len"
        )
