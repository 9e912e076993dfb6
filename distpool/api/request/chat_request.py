"""`POST /v1/chat/completions`: its body, checked. `messages` are rendered by the tokenizer's chat
template; content is a string or a list of text parts."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from distpool.api.errors import unsupported
from distpool.api.request.request_fields import RequestFields

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Role
    content: Any = Field(
        default=None, validate_default=True
    )  # str | list of {"type": "text", "text": ...} parts, checked by `_text`
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, value: Any) -> str:
        """The message's text: a string, or its text parts joined (other part types are refused)."""
        if value is None or isinstance(value, str):
            return value or ""
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of text parts")
        texts = []
        for i, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(
                    f"part {i} must be {{'type': 'text', 'text': '...'}}: only text is supported"
                )
            texts.append(part["text"])
        return "".join(texts)

    def for_template(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.content}
        return {**message, "name": self.name} if self.name else message


class ChatRequest(RequestFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise unsupported("logprobs", self.logprobs, "logprobs=false")
        if self.top_logprobs is not None:
            raise unsupported("top_logprobs", self.top_logprobs, "an absent top_logprobs")
        if self.tools:
            raise unsupported("tools", f"{len(self.tools)} tools", "no tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise unsupported("response_format", self.response_format, '{"type": "text"}')
