"""Server-sent events as OpenAI streams them: `data: {json}` and a blank line per chunk, then
`data: [DONE]`."""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def sse_data(payload: dict) -> bytes:
    """One event. JSON keeps non-ASCII text as is (UTF-8) and has no newline, so one line holds it."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def parse_sse(stream: bytes) -> list[dict | str]:
    """The events of an SSE body, in order: each JSON payload as a dict, `[DONE]` as the string.
    ValueError for anything that is not `data: ...` events separated by blank lines."""
    events: list[dict | str] = []
    text = stream.decode()
    if not text.endswith("\n\n"):
        raise ValueError("an SSE body ends with a blank line")
    for block in text[:-2].split("\n\n"):
        if not block.startswith("data: ") or "\n" in block:
            raise ValueError(f"not one data line: {block[:80]!r}")
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
