"""A request body read within its limit and checked into its model: every way a body can be bad
(too large, not JSON, not an object, a wrong type, a value out of range) is an ApiError 400 whose
message names the field."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from distpool.api.errors import ApiError, bad_request

MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt within a context, far below a worker's memory
Model = TypeVar("Model", bound=BaseModel)


def _too_large(size: str) -> ApiError:
    return ApiError(
        status=400,
        message=f"the request body is {size}; at most {MAX_BODY_BYTES} bytes (4 MiB)",
        code="body_too_large",
    )


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, refused as soon as its declared or received size passes `limit`."""
    declared = request.headers.get("content-length", "")
    if declared.isdecimal() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(model: type[Model], body: bytes) -> Model:
    """The body as `model`: strict JSON types, OpenAI's field names."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, as one line naming the field (dotted, list indices kept)."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first['msg']}", code="invalid_json")
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "model_type" and param is None:
        return bad_request("the body must be a JSON object", code="invalid_type")
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        return bad_request(f"{param} is required", param=param, code="missing_field")
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return bad_request(f"{param}: {message}; got {shown}", param=param, code="invalid_value")
