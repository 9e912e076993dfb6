"""What the decode worker keeps of one request, from its reservation until its result is handed out."""

from __future__ import annotations

from dataclasses import dataclass, field

from distpool.facts import Facts
from distpool.model.sampling import LENGTH, Finish, SamplingParams, finish_after
from distpool.model_impl.pool_model import Mismatch
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
    mismatch: Mismatch | None = None  # CORRUPT: the first wrong byte, where the model found one
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
            return DecodeFailed(
                kind=self.failure, reason=self.error, retry=self.retry, mismatch=self.mismatch
            )
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


# What is wrong with a request decode is asked to reserve (`RequestRefused.problem`).
BAD_PROMPT = "bad_prompt"  # not a list of token ids in [0, vocab_size)
NO_PARAMS = "no_params"  # no SamplingParams: `got` names what came instead
NO_SEED = "no_seed"  # it samples (temperature > 0) without a seed
NOTHING_TO_DO = "nothing_to_do"  # an empty prompt, or no new token asked for
OVER_CONTEXT = "over_context"  # prompt and new tokens take `needed` tokens, over `context_len`


class RequestRefused(Facts, ValueError):
    """Decode refused to reserve `request_id`: `problem` (one of the names above) and its facts:
    `vocab_size` (BAD_PROMPT), `got` (NO_PARAMS), `prompt_len` and `max_new_tokens` (NOTHING_TO_DO,
    OVER_CONTEXT), `context_len` (OVER_CONTEXT). Nothing is held."""

    def __init__(
        self,
        request_id: str,
        problem: str,
        *,
        vocab_size: int = 0,
        got: str = "",
        prompt_len: int = 0,
        max_new_tokens: int = 0,
        context_len: int = 0,
    ) -> None:
        self.request_id, self.problem = request_id, problem
        self.vocab_size, self.got = vocab_size, got
        self.prompt_len, self.max_new_tokens, self.context_len = prompt_len, max_new_tokens, context_len
        super().__init__(self._describe())

    @property
    def needed(self) -> int:
        """The tokens the request would take: its prompt and every new token."""
        return self.prompt_len + self.max_new_tokens

    def _describe(self) -> str:
        rid = self.request_id
        if self.problem == BAD_PROMPT:
            return f"the prompt of {rid!r} must be a list of token ids in [0, {self.vocab_size})"
        if self.problem == NO_PARAMS:
            return f"request {rid!r} needs its SamplingParams, got {self.got}"
        if self.problem == NO_SEED:
            return f"request {rid!r} samples without a seed"
        if self.problem == NOTHING_TO_DO:
            return f"prompt_len and max_new_tokens must be >= 1; got {self.prompt_len}, {self.max_new_tokens}"
        return (
            f"request {rid!r} needs {self.needed} tokens, more than the pool's context length "
            f"{self.context_len}"
        )


def check_request(
    request_id: str, prompt: object, params: SamplingParams, vocab_size: int, context_len: int
) -> None:
    """Raise RequestRefused unless `prompt` is a non-empty list of token ids in the vocabulary, the
    request brings its SamplingParams (a seed if it samples) and it fits the context length once it
    has all its new tokens."""
    if not isinstance(prompt, list) or not all(type(t) is int and 0 <= t < vocab_size for t in prompt):
        raise RequestRefused(request_id, BAD_PROMPT, vocab_size=vocab_size)
    if not isinstance(params, SamplingParams):
        raise RequestRefused(request_id, NO_PARAMS, got=type(params).__name__)
    if not params.greedy and params.seed is None:
        raise RequestRefused(request_id, NO_SEED)
    facts = {"prompt_len": len(prompt), "max_new_tokens": params.max_tokens}
    if len(prompt) < 1 or params.max_tokens < 1:
        raise RequestRefused(request_id, NOTHING_TO_DO, **facts)
    if len(prompt) + params.max_tokens > context_len:
        raise RequestRefused(request_id, OVER_CONTEXT, **facts, context_len=context_len)
