"""The front end's own settings: who may call it and how many requests may wait."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_WAITING_REQUESTS = 256


@dataclass(frozen=True)
class ApiSettings:
    """`api_key`: the bearer token every /v1 call must carry (None: open). `max_waiting_requests`:
    choices accepted whose first token has not come yet, beyond which a request gets 503 and
    `Retry-After: retry_after_s`."""

    api_key: str | None = None
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")
        if type(self.max_waiting_requests) is not int or self.max_waiting_requests < 1:
            raise ValueError(
                f"max_waiting_requests must be a whole number >= 1; got {self.max_waiting_requests!r}"
            )
