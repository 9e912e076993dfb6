"""Who gets in, before any work: the bearer token, then room among the waiting requests."""

from __future__ import annotations

import hmac

from fastapi import Request

from distpool.api.errors import AUTHENTICATION, OVERLOADED, ApiError
from distpool.api.settings import ApiSettings


def check_api_key(request: Request, settings: ApiSettings) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (when a key is set)."""
    if settings.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), settings.api_key.encode()
    ):
        raise ApiError(
            status=401,
            message="missing or wrong API key: send the header 'Authorization: Bearer <key>'",
            type=AUTHENTICATION,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


class WaitingRoom:
    """Counts choices accepted whose first token has not come yet (waiting for or in prefill)."""

    def __init__(self, settings: ApiSettings) -> None:
        self._settings = settings
        self.num_waiting = 0

    def admit(self, num_choices: int) -> None:
        """Room for `num_choices` more, or 503 with Retry-After."""
        limit = self._settings.max_waiting_requests
        if self.num_waiting + num_choices > limit:
            raise busy(
                self._settings.retry_after_s, f"{self.num_waiting} requests are waiting (at most {limit})"
            )
        self.num_waiting += num_choices

    def leave(self) -> None:
        """One choice got its first token, or ended before it."""
        if self.num_waiting <= 0:
            raise RuntimeError("a choice left the waiting room twice")
        self.num_waiting -= 1


def busy(retry_after_s: int, why: str) -> ApiError:
    return ApiError(
        status=503,
        message=f"the server is busy: {why}; retry after {retry_after_s} s",
        type=OVERLOADED,
        code="server_busy",
        headers={"Retry-After": str(retry_after_s)},
    )
