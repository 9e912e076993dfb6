"""One streamed request to an OpenAI-compatible endpoint, timed at the client (httpx, async).

Times are `time.perf_counter()` seconds. As `vllm bench serve` times them: TTFT is the arrival of
the first chunk with choices (the server made a token, even if its text is held back or is only
chat's role), ITL each gap between two such chunks, latency (E2EL) the last such chunk (the usage
chunk and `[DONE]` after it do not count). Output tokens are the server's `usage.completion_tokens`
(asked for with `stream_options.include_usage`), else the token ids streamed, else the chunks with
choices.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = {"completions": COMPLETIONS, "chat": CHAT}


@dataclass
class RequestResult:
    """What one request measured. `start_s`: when it was sent (perf_counter); the rest in seconds
    after it. A failed request keeps its `error` and counts in no latency figure."""

    start_s: float
    planned_prompt_len: int
    success: bool = False
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    error: str = ""


async def stream_request(
    http: httpx.AsyncClient, path: str, payload: dict, planned_prompt_len: int
) -> RequestResult:
    """POST `payload` (with `stream: true`) to `path` and read its server-sent events as they come."""
    start = time.perf_counter()
    result = RequestResult(start_s=start, planned_prompt_len=planned_prompt_len)
    chunks, last, texts, usage = 0, start, [], None
    try:
        async with http.stream("POST", path, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if not chunk.get("choices"):
                    continue  # the usage chunk
                text, ids = _output_of(chunk)
                if chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                chunks, last = chunks + 1, now
                texts.append(text)
                result.token_ids.extend(ids)
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result.latency_s = last - start
    if chunks == 0:
        result.error = "the stream ended without output"
        return result
    result.text = "".join(texts)
    result.prompt_tokens = int(usage["prompt_tokens"]) if usage else planned_prompt_len
    result.output_tokens = int(usage["completion_tokens"]) if usage else (len(result.token_ids) or chunks)
    result.success = True
    return result


def _output_of(chunk: dict) -> tuple[str, list[int]]:
    """The text and token ids a chunk carries, over its choices (completions' `text`, chat's
    `delta.content`; `token_ids` where a server without a tokenizer sends ids)."""
    text, ids = "", []
    for choice in chunk["choices"]:
        delta = choice.get("delta")
        text += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
        ids.extend(choice.get("token_ids") or ())
    return text, ids
