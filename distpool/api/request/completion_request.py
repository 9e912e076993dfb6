"""`POST /v1/completions`: its body, checked. `prompt` is text, a list of token ids, or a list of
either (one choice per prompt)."""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from distpool.api.errors import unsupported
from distpool.api.request.request_fields import RequestFields

MAX_PROMPTS = 64  # choices in one request


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


class CompletionRequest(RequestFields):
    prompt: Any  # str | list[int] | list[str | list[int]], checked by `_prompts`
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> tuple[str | tuple[int, ...], ...]:
        """Every prompt as text or a tuple of ids; a list of ids is one prompt, not many."""
        if isinstance(value, str):
            prompts: list[Any] = [value]
        elif _is_id_list(value) and value:
            prompts = [value]
        elif isinstance(value, list) and value:
            prompts = value
        else:
            raise ValueError("must be a string, a list of token ids, or a non-empty list of those")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"holds {len(prompts)} prompts; at most {MAX_PROMPTS}")
        checked: list[str | tuple[int, ...]] = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str) and prompt:
                checked.append(prompt)
            elif _is_id_list(prompt) and prompt and all(t >= 0 for t in prompt):
                checked.append(tuple(prompt))
            else:
                raise ValueError(
                    f"prompt {i} must be a non-empty string or a non-empty list of token ids >= 0"
                )
        return tuple(checked)

    @property
    def prompts(self) -> tuple[str | tuple[int, ...], ...]:
        return self.prompt  # a tuple once validated

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise unsupported("echo", self.echo, "echo=false")
        if self.logprobs is not None:
            raise unsupported("logprobs", self.logprobs, "an absent logprobs")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", self.best_of, "best_of=1")
        if self.suffix:
            raise unsupported("suffix", self.suffix, "an absent suffix")
