"""A checked request turned into the choices the engine generates: prompts tokenized and held
against the model's vocabulary and context, max_tokens settled, stop ids checked."""

from __future__ import annotations

from dataclasses import dataclass

from distpool.api.engine import ModelCard
from distpool.api.errors import bad_request
from distpool.api.request.chat_request import ChatRequest
from distpool.api.request.completion_request import CompletionRequest
from distpool.api.request.request_fields import RequestFields
from distpool.api.request.tokenizer import ApiTokenizer
from distpool.api.stream.choice import ChoiceJob

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the context's rest


@dataclass(frozen=True)
class PreparedPrompt:
    prompt_ids: tuple[int, ...]
    max_tokens: int


def completion_prompts(
    request: CompletionRequest, card: ModelCard, tokenizer: ApiTokenizer | None
) -> list[PreparedPrompt]:
    prepared = []
    for i, prompt in enumerate(request.prompts):
        param = "prompt" if len(request.prompts) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            if tokenizer is None:
                raise bad_request(
                    f"{param} is text, but the model has no tokenizer: send token ids",
                    param=param,
                    code="no_tokenizer",
                )
            ids = tokenizer.encode_prompt(prompt)
        else:
            ids = prompt
        prepared.append(_within_model(ids, request, card, param, COMPLETION_DEFAULT_MAX_TOKENS))
    return prepared


def chat_prompt(request: ChatRequest, card: ModelCard, tokenizer: ApiTokenizer | None) -> PreparedPrompt:
    if tokenizer is None:
        raise bad_request(
            "the model has no tokenizer and so no chat template: use /v1/completions with token ids",
            param="messages",
            code="no_chat_template",
        )
    ids = tokenizer.render_chat([m.for_template() for m in request.messages])
    return _within_model(ids, request, card, "messages", None)


def check_request_ids(request: RequestFields, card: ModelCard, tokenizer: ApiTokenizer | None) -> None:
    """Stop ids inside the vocabulary; stop strings only where text exists."""
    _ids_in_vocab(tuple(request.stop_token_ids), card, "stop_token_ids")
    if request.stop_strings and tokenizer is None:
        raise bad_request("stop strings need the model's tokenizer: use stop_token_ids", param="stop")


def _within_model(
    ids: tuple[int, ...], request: RequestFields, card: ModelCard, param: str, default_max: int | None
) -> PreparedPrompt:
    if not ids:
        raise bad_request(f"{param} is empty once tokenized", param=param)
    _ids_in_vocab(ids, card, param)
    room = card.context_len - len(ids)
    if room < 1:
        raise bad_request(
            f"{param} is {len(ids)} tokens; this model's context is {card.context_len} tokens, which leaves "
            "no room for a generated token: shorten it",
            param=param,
            code="context_length_exceeded",
        )
    if request.min_tokens > room:
        raise bad_request(
            f"min_tokens={request.min_tokens} does not fit: this model's context is {card.context_len} "
            f"tokens and {param} is {len(ids)}, which leaves {room}",
            param="min_tokens",
            code="context_length_exceeded",
        )
    asked = request.requested_max_tokens()
    if asked is None:  # the default, raised to min_tokens where that asks for more
        return PreparedPrompt(ids, min(max(default_max or room, request.min_tokens), room))
    if asked > room:
        name = (
            "max_completion_tokens"
            if isinstance(request, ChatRequest) and request.max_completion_tokens
            else "max_tokens"
        )
        raise bad_request(
            f"this model's context is {card.context_len} tokens; {param} is {len(ids)} tokens and "
            f"{name} asks {asked} more ({len(ids) + asked} in all): "
            f"lower {name} to {room} or less, or shorten the prompt",
            param=name,
            code="context_length_exceeded",
        )
    return PreparedPrompt(ids, asked)


def _ids_in_vocab(ids: tuple[int, ...], card: ModelCard, param: str) -> None:
    outside = [t for t in ids if not 0 <= t < card.vocab_size]
    if outside:
        raise bad_request(
            f"{param} holds token id {outside[0]} ({len(outside)} outside in all); this model's ids are "
            f"0 to {card.vocab_size - 1}",
            param=param,
            code="token_id_out_of_range",
        )


def choice_jobs(
    request: RequestFields, request_id: str, prompts: list[PreparedPrompt]
) -> tuple[ChoiceJob, ...]:
    return tuple(
        ChoiceJob(
            index=i,
            request_id=f"{request_id}-{i}",
            prompt_ids=p.prompt_ids,
            args=request.generation_args(p.max_tokens),
            stop_strings=request.stop_strings,
        )
        for i, p in enumerate(prompts)
    )
