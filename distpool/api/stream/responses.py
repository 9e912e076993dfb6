"""OpenAI's response bodies: whole responses and streamed chunks of completions and chat
completions, and their `usage`. Plain JSON-ready dicts, built here only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResponseHead:
    """What every chunk of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def body(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choice_body(head: ResponseHead, index: int, text: str, finish_reason: str | None, token_ids=None) -> dict:
    """A whole choice (`message` for chat, `text` for completions). `token_ids`: only for a model
    without a tokenizer, whose text is empty."""
    if head.chat:
        choice = {"index": index, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": index, "text": text}
    choice.update(logprobs=None, finish_reason=finish_reason)
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def chunk_choice(
    head: ResponseHead,
    index: int,
    text: str,
    finish_reason: str | None,
    *,
    role: bool = False,
    token_ids=None,
) -> dict:
    """One streamed choice. Chat: `delta.role` on a choice's first chunk, `delta.content` after."""
    if head.chat:
        delta: dict = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text}
    choice.update(logprobs=None, finish_reason=finish_reason)
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def whole_response(
    head: ResponseHead, choices: list[dict], prompt_tokens: int, completion_tokens: int
) -> dict:
    return {**head.body(head.object, choices), "usage": usage(prompt_tokens, completion_tokens)}


def chunk(head: ResponseHead, choices: list[dict]) -> dict:
    return head.body(head.chunk_object, choices)


def usage_chunk(head: ResponseHead, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last chunk with `stream_options.include_usage`: no choices, the whole request's usage."""
    return {**head.body(head.chunk_object, []), "usage": usage(prompt_tokens, completion_tokens)}
