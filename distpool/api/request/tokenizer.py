"""The served model's tokenizer as the front end uses it: completion prompts encoded (special tokens
as the tokenizer adds them), chat messages rendered by its chat template, generated ids decoded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from distpool.api.errors import bad_request
from distpool.model_impl.hf.tokenizer import PromptTokenizer, find_tokenizer


@dataclass(frozen=True)
class ApiTokenizer:
    loaded: PromptTokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.loaded.tokenizer, "chat_template", None))

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        return tuple(self.loaded.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.loaded.decode(ids)

    def render_chat(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        """The messages through the chat template with the generation prompt added, then encoded as
        the template wrote them (its own BOS, none added). A template's refusal (e.g. roles that do not
        alternate) is a 400 with its words."""
        if not self.has_chat_template:
            raise bad_request(
                f"the model ({Path(self.loaded.folder).name}) has no chat template, so /v1/chat/completions "
                "cannot render messages: use /v1/completions with a prompt",
                param="messages",
                code="no_chat_template",
            )
        tokenizer = self.loaded.tokenizer
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template is the checkpoint's: its refusal is about these messages
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise bad_request(
                f"the chat template refused these messages: {reason}", param="messages"
            ) from None
        return tuple(tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer(folder: str | None) -> ApiTokenizer | None:
    """The tokenizer in the model folder the engine names, None when it names none."""
    if folder is None:
        return None
    loaded = find_tokenizer(Path(folder) / "config.json")
    if loaded is None:
        raise ValueError(f"{folder} holds no tokenizer files (tokenizer.json or tokenizer_config.json)")
    return ApiTokenizer(loaded)
