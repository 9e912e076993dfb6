"""A request's generation parameters (`SamplingParams`), how its token i is to be picked
(`TokenPick`), and why it ended (`Finish`): plain values every layer that carries a request imports.

The arithmetic of a pick lives in `distpool.model_impl.sampling`. What is decided here, once for every
worker and the parity check:

    token i is picked      with `pick_for(params, eos, i)`: EOS and stop ids banned while i < min_tokens
    the request ends       after token i when `finish_after(params, eos, tokens)` says so: an EOS id
                           (unless ignore_eos) or a stop id once min_tokens are made, else max_tokens

A request's seed is its own (`seed`), or drawn from the run's seed and its id (`with_seed`) where the
request enters, so the same run gives the same tokens.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from distpool.facts import Facts

MAX_SEED = (1 << 63) - 1


class SamplingError(Facts, ValueError):
    """A generation parameter outside its range: the field, the value, and what it may be."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        super().__init__(f"{field} must be {allowed}; got {value!r}")
        self.field, self.value, self.allowed = field, value, allowed


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_number(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. `temperature` 0 is greedy (the default); `top_k` 0 and `top_p` 1
    keep every token. Checked when built: a bad value raises SamplingError."""

    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop ids are suppressed until this many tokens are made
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: drawn from the run's seed where the request enters (`with_seed`)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingError("max_tokens", self.max_tokens, "a whole number >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(
                "min_tokens", self.min_tokens, f"a whole number in [0, max_tokens={self.max_tokens}]"
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise SamplingError("temperature", self.temperature, "a finite number >= 0 (0: greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingError("top_p", self.top_p, "a number in (0, 1] (1: off)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingError("top_k", self.top_k, "a whole number >= 0 (0: off)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise SamplingError("seed", self.seed, f"a whole number in [0, {MAX_SEED}]")
        stops = self.stop_token_ids
        if not isinstance(stops, tuple) or not all(_is_int(t) and t >= 0 for t in stops):
            raise SamplingError("stop_token_ids", stops, "a list of token ids (whole numbers >= 0)")
        if type(self.ignore_eos) is not bool:
            raise SamplingError("ignore_eos", self.ignore_eos, "true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self, run_seed: int, request_id: str) -> SamplingParams:
        """These parameters with a seed: its own, else one drawn from `run_seed` and `request_id`."""
        if self.seed is not None:
            return self
        digest = hashlib.blake2b(f"{run_seed}\0{request_id}".encode(), digest_size=8).digest()
        return replace(self, seed=int.from_bytes(digest, "little") & MAX_SEED)


@dataclass(frozen=True)
class TokenPick:
    """How to pick token `index` (0: the first, prefill's) of a request: its parameters, and the ids
    it may not pick now (EOS and stop ids before `min_tokens`)."""

    params: SamplingParams
    index: int
    banned: tuple[int, ...] = ()


@dataclass(frozen=True)
class Finish:
    """Why a request ended: "stop" (at `stop_token`, an EOS or a stop id) or "length" (max_tokens)."""

    reason: str  # "stop" | "length"
    stop_token: int | None = None


LENGTH = Finish("length")


def stop_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The ids that end the request once `min_tokens` are made."""
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return tuple(dict.fromkeys((*eos, *params.stop_token_ids)))


def pick_for(params: SamplingParams, eos_token_ids: Sequence[int], index: int) -> TokenPick:
    """How token `index` is picked: EOS and stop ids banned while fewer than `min_tokens` precede it."""
    banned = stop_ids(params, eos_token_ids) if index < params.min_tokens else ()
    return TokenPick(params=params, index=index, banned=banned)


def finish_after(
    params: SamplingParams, eos_token_ids: Sequence[int], tokens: Sequence[int]
) -> Finish | None:
    """Whether the request ends after `tokens` (every token generated so far), and why."""
    if not tokens:
        return None
    if len(tokens) > params.min_tokens and tokens[-1] in stop_ids(params, eos_token_ids):
        return Finish("stop", tokens[-1])
    return LENGTH if len(tokens) >= params.max_tokens else None


def truncated(params: SamplingParams, eos_token_ids: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """`tokens` cut where `finish_after` ends them (an oracle that ran to max_tokens)."""
    for n in range(1, len(tokens) + 1):
        if finish_after(params, eos_token_ids, tokens[:n]) is not None:
            return list(tokens[:n])
    return list(tokens)
