"""The model folder's tokenizer: text prompts in, generated text out.

A folder holding a Hugging Face tokenizer (`tokenizer.json` or `tokenizer_config.json` beside its
`config.json`) tokenizes the `{"prompt": "text"}` lines of `--prompts` and detokenizes what `--outputs`
writes, whatever implementation computes. Without one (a preset, a loose config file, a folder
without tokenizer files), text prompts are UTF-8 bytes modulo the vocabulary. transformers is imported
only when a folder holds a tokenizer, so runs without one never pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distpool.model_impl.errors import TokenizerUnloadable
from distpool.model_impl.hf.source import model_folder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class PromptTokenizer:
    """A loaded tokenizer and the folder it came from (for error messages)."""

    folder: str
    tokenizer: Any  # transformers' PreTrainedTokenizerBase

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens added as the tokenizer's own configuration says
        (a BOS token where it has one), as `generate` users and vLLM's completions do."""
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        """The text of generated ids, special tokens left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def holds_tokenizer(config_path: Path) -> bool:
    """Whether the model's folder holds tokenizer files beside its config.json."""
    if config_path.name != "config.json":
        return False  # a preset or a loose config file: never a tokenizer
    return any((config_path.parent / name).is_file() for name in TOKENIZER_FILES)


def find_tokenizer(config_path: Path) -> PromptTokenizer | None:
    """The tokenizer of the model at `config_path` (offline), or None when its folder holds none.
    TokenizerUnloadable (the folder, its files, what transformers said) when one is there but cannot
    be loaded."""
    if not holds_tokenizer(config_path):
        return None
    folder = model_folder(config_path)
    from transformers import AutoTokenizer  # only a folder with a tokenizer pays for transformers

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # its files are the user's: any failure is a bad input, said in one line
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise TokenizerUnloadable(str(folder), TOKENIZER_FILES, reason) from None
    return PromptTokenizer(folder=str(folder), tokenizer=tokenizer)
