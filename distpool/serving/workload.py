"""Workloads for the main job: generated (seeded, mixed prompt lengths) or read from a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from distpool.memory.envelope import MAX_REQUEST_ID_CHARS as MAX_ID_CHARS  # an id must fit an envelope


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int


def generate(
    num_requests: int, *, vocab_size: int, min_prompt: int, max_prompt: int, max_new_tokens: int, seed: int
) -> list[Request]:
    """Prompts of uniformly mixed lengths in [min_prompt, max_prompt], random token ids."""
    if num_requests < 1 or not 1 <= min_prompt <= max_prompt or max_new_tokens < 1:
        raise ValueError(
            f"bad workload: requests={num_requests}, prompt lengths [{min_prompt}, {max_prompt}], "
            f"max_new_tokens={max_new_tokens}; all must be >= 1 and min <= max"
        )
    rng = random.Random(seed)
    return [
        Request(
            request_id=f"req-{i:05d}",
            prompt=[rng.randrange(vocab_size) for _ in range(rng.randint(min_prompt, max_prompt))],
            max_new_tokens=max_new_tokens,
        )
        for i in range(num_requests)
    ]


def load_jsonl(path: str | Path, *, vocab_size: int, max_new_tokens: int) -> list[Request]:
    """One request per line: {"prompt_ids": [int, ...]} or {"prompt": "text"} (UTF-8 bytes mod vocab),
    with optional "max_new_tokens" and "id"."""
    requests = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read prompts file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"prompts file {path} is not UTF-8 text (byte {exc.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise ValueError(f"{where}: the JSON nests too deeply to be a prompt") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        if "prompt_ids" in row:
            ids = row["prompt_ids"]
            if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
                raise ValueError(f"{where}: prompt_ids must be a list of ints in [0, {vocab_size})")
        elif isinstance(row.get("prompt"), str):
            ids = [b % vocab_size for b in row["prompt"].encode()]
        else:
            raise ValueError(f'{where}: needs "prompt_ids" (list of ints) or "prompt" (string)')
        new = row.get("max_new_tokens", max_new_tokens)
        if not ids or type(new) is not int or new < 1:
            raise ValueError(f"{where}: the prompt must be non-empty and max_new_tokens an int >= 1")
        rid = row.get("id", f"req-{number:05d}")
        if not isinstance(rid, (str, int)) or isinstance(rid, bool) or not 0 < len(str(rid)) <= MAX_ID_CHARS:
            raise ValueError(f"{where}: id must be a string (or number) of 1 to {MAX_ID_CHARS} characters")
        requests.append(Request(request_id=str(rid), prompt=ids, max_new_tokens=new))
    if not requests:
        raise ValueError(f"{path}: no requests")
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError(f"{path}: request ids must be unique")
    return requests
