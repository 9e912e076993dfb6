"""A byte-level tokenizer made at test time: one token per UTF-8 byte (so a multi-byte character
spans several tokens), `<s>` before every prompt, `</s>` as EOS, and an optional chat template."""

from __future__ import annotations

import json
from pathlib import Path

BOS_ID, EOS_ID = 256, 257
VOCAB_SIZE = 260  # two ids past the specials: inside the vocabulary, never decoded to text
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_ids(text: str) -> list[int]:
    """The ids of `text` without `<s>`: its UTF-8 bytes."""
    return list(text.encode())


def save_byte_tokenizer(folder: Path, chat_template: bool = True) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"vocab_size": VOCAB_SIZE}))
    return folder


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
