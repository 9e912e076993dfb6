"""ShareGPT-format conversations: a JSON list of {"conversations": [{"from", "value"}, ...]}, where
"from" is "human" (or "user") for a prompt and "gpt" (or "assistant", "chatgpt", "bard") for a reply."""

from __future__ import annotations

import json
import random
from pathlib import Path

from distpool.bench.sessions import Session, Turn

HUMAN = frozenset({"human", "user"})
MODEL = frozenset({"gpt", "assistant", "chatgpt", "bard", "model"})
CHARS_PER_TOKEN = 4  # a reply's length in tokens, estimated without a tokenizer (OpenAI's rule of thumb)


def load_sharegpt(
    path: str | Path, num_requests: int, *, multi_turn: bool, output_len: int | None, seed: int
) -> list[Session]:
    """Sessions from a ShareGPT file, shuffled by `seed`, `num_requests` turns in all (fewer if the
    file holds fewer). A turn is a human message followed by a reply; single-turn takes each
    conversation's first. A turn's output length is `output_len`, else its reply's length estimated
    at CHARS_PER_TOKEN characters a token. ValueError names the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read --dataset-path {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--dataset-path {path} is not a ShareGPT JSON file: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of conversations")
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    sessions: list[Session] = []
    remaining = num_requests
    for index in order:
        if remaining == 0:
            break
        turns = _turns(data[index], output_len)[: remaining if multi_turn else 1]
        if turns:
            entry = data[index]
            name = str(entry.get("id", index)) if isinstance(entry, dict) else str(index)
            sessions.append(Session(session_id=f"sharegpt-{name}", turns=tuple(turns)))
            remaining -= len(turns)
    if not sessions:
        raise ValueError(
            f"--dataset-path {path} holds no conversation with a human message followed by a reply "
            '({"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]})'
        )
    return sessions


def _turns(entry: object, output_len: int | None) -> list[Turn]:
    """The entry's (human, reply) pairs in order, up to the first message out of that pattern."""
    messages = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(messages, list):
        return []
    turns = []
    for prompt, reply in zip(messages[::2], messages[1::2], strict=False):
        if not (_is(prompt, HUMAN) and _is(reply, MODEL)):
            break
        length = output_len or max(1, round(len(reply["value"]) / CHARS_PER_TOKEN))
        turns.append(Turn(prompt_ids=None, text=prompt["value"], output_len=length))
    return turns


def _is(message: object, senders: frozenset[str]) -> bool:
    return (
        isinstance(message, dict)
        and str(message.get("from", "")).lower() in senders
        and isinstance(message.get("value"), str)
        and bool(message["value"].strip())
    )
