"""OpenAI's error shape: every refusal the front end makes is an `ApiError`, answered as
`{"error": {"message", "type", "param", "code"}}` with its status (never a traceback)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from distpool.facts import Facts

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
SERVER = "server_error"
OVERLOADED = "overloaded_error"


class ApiError(Facts, Exception):
    """A refusal: HTTP `status`, a message naming the field (`param`, dotted) and the fix."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(status=400, message=message, param=param, code=code)


def unsupported(param: str, value: object, supported: str) -> ApiError:
    """An OpenAI field set to a value this server does not implement."""
    return bad_request(
        f"{param}={value!r} is not supported: only {supported}", param=param, code="unsupported_parameter"
    )
