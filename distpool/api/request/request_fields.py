"""The fields completions and chat completions share: sampling, stopping, streaming, and the OpenAI
fields this server accepts only at their default value.

Types are strict (a string is not a number, `true` is not 1); ranges are those of issue 35's
`SamplingParams`. Fields nobody here knows are kept aside (`model_extra`) and logged once each.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from distpool.api.engine import GenerationArgs
from distpool.api.errors import bad_request, unsupported

log = logging.getLogger(__name__)
MAX_SEED = (1 << 63) - 1
MAX_STOP_STRINGS = 16
_logged_unknown: set[tuple[str, str]] = set()


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    include_usage: bool = False


class RequestFields(BaseModel):
    """What both endpoints accept. A subclass adds its prompt and its own unsupported fields."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)  # greedy unless asked, as `distpool run`
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: Any = Field(
        default=None, validate_default=True
    )  # a string or a list of strings: checked by `_stop_strings`
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's extension: each choice carries its generated ids too
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, unused
    # OpenAI fields accepted only at their defaults (`check_supported`)
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: Any) -> tuple[str, ...]:
        stops = (value,) if isinstance(value, str) else value
        if stops is None:
            return ()
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"holds {len(stops)} strings; at most {MAX_STOP_STRINGS}")
        return tuple(dict.fromkeys(stops))

    @field_validator("stop_token_ids")
    @classmethod
    def _whole_ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token ids are whole numbers >= 0")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.stop  # a tuple once validated

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        """The caller's cap on generated tokens (chat's `max_completion_tokens` overrides this)."""
        return self.max_tokens

    def check_supported(self) -> None:
        """ApiError 400 naming the first OpenAI field set to a value this server does not implement."""
        if self.n != 1:
            raise unsupported("n", self.n, "n=1 (one choice per prompt)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise unsupported(name, getattr(self, name), "0 (no penalties)")
        if self.logit_bias:
            raise unsupported("logit_bias", self.logit_bias, "an empty or absent logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is allowed only with stream=true", param="stream_options")
        cap = self.requested_max_tokens()
        if cap is not None and self.min_tokens > cap:
            raise bad_request(
                f"min_tokens={self.min_tokens} is more than the max_tokens={cap}", param="min_tokens"
            )

    def log_unknown_fields(self, endpoint: str) -> None:
        """Clients send fields of their own: each unknown one is logged once per endpoint, then ignored."""
        for name in self.model_extra or {}:
            if (endpoint, name) not in _logged_unknown:
                _logged_unknown.add((endpoint, name))
                log.warning("%s: ignoring unknown field %r", endpoint, name)

    def generation_args(self, max_tokens: int) -> GenerationArgs:
        return GenerationArgs(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(self.top_k, 0),
            seed=self.seed,
            stop_token_ids=tuple(dict.fromkeys(self.stop_token_ids)),
            ignore_eos=self.ignore_eos,
        )
