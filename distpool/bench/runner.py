"""One benchmark run at one request rate: each session starts at its arrival offset, its turns go one
after another (each after the previous reply), at most `max_concurrency` requests in flight."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from distpool.bench.client import ENDPOINTS, RequestResult, stream_request
from distpool.bench.sessions import Session, Turn


@dataclass(frozen=True)
class Target:
    """Where and how requests go: `endpoint` "completions" (token-id prompts where the dataset has
    ids) or "chat" (text); `model` is every request's `model` field."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0


@dataclass(frozen=True)
class RateRun:
    results: list[
        RequestResult
    ]  # one per planned request (turns never sent because an earlier one failed: failed)
    duration_s: float  # from the first arrival to the last answer


def run_at_rate(target: Target, sessions: list[Session], offsets: list[float]) -> RateRun:
    if len(offsets) != len(sessions):
        raise ValueError(f"{len(offsets)} arrival offsets for {len(sessions)} sessions")
    return asyncio.run(_run(target, sessions, offsets))


def probe_request(target: Target, session: Session) -> RequestResult:
    """A test request before the runs (not counted), as `vllm bench serve` sends: it checks the flags
    against the server and warms it up. It is `session`'s first turn reversed, of the same length,
    so that a prefix cache holds nothing of the workload afterwards."""
    first = Session(session_id=session.session_id, turns=session.turns[:1])
    probe = reversed_session(first, f"{session.session_id}-test")
    return asyncio.run(_run(target, [probe], [0.0])).results[0]


def reversed_session(session: Session, session_id: str) -> Session:
    """`session` with every turn's prompt reversed: the same lengths, other tokens."""
    turns = tuple(
        Turn.of_ids(t.prompt_ids[::-1], t.output_len)
        if t.prompt_ids is not None
        else Turn(prompt_ids=None, text=" ".join(t.text.split()[::-1]), output_len=t.output_len)
        for t in session.turns
    )
    return Session(session_id=session_id, turns=turns)


async def _run(target: Target, sessions: list[Session], offsets: list[float]) -> RateRun:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    limit = target.max_concurrency
    http = httpx.AsyncClient(
        base_url=target.base_url,
        headers=headers,
        timeout=httpx.Timeout(target.request_timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )
    gate = asyncio.Semaphore(limit) if limit else None
    async with http:
        start = time.perf_counter()
        per_session = await asyncio.gather(
            *(
                _session(http, target, s, start + at, gate, i)
                for i, (s, at) in enumerate(zip(sessions, offsets, strict=True))
            )
        )
        duration = time.perf_counter() - start
    return RateRun(results=[r for results in per_session for r in results], duration_s=duration)


async def _session(
    http: httpx.AsyncClient, target: Target, session: Session, at: float, gate, index: int
) -> list[RequestResult]:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    history = _History(target.endpoint, random.Random(index))
    results: list[RequestResult] = []
    for k, turn in enumerate(session.turns):
        body, planned = history.body_for(turn, target.model)
        if gate is None:
            result = await stream_request(http, ENDPOINTS[target.endpoint], body, planned)
        else:
            async with gate:
                result = await stream_request(http, ENDPOINTS[target.endpoint], body, planned)
        results.append(result)
        if not result.success:
            error = f"not sent: turn {k} of {session.session_id} failed"
            unsent = len(session.turns) - k - 1
            results += [
                RequestResult(start_s=result.start_s, planned_prompt_len=0, error=error)
                for _ in range(unsent)
            ]
            break
        history.add_reply(result)
    return results


class _History:
    """A conversation so far, as the next request's prompt: chat's messages, or a completions prompt
    (token ids, or text for a dataset of text) holding every earlier prompt and reply."""

    def __init__(self, endpoint: str, rng: random.Random) -> None:
        self.endpoint, self.rng = endpoint, rng
        self.messages: list[dict] = []
        self.prompt: list[int] | str | None = None

    def body_for(self, turn: Turn, model: str) -> tuple[dict, int]:
        """The request's body and its prompt's planned length."""
        common = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
        common.update(ignore_eos=True, temperature=0.0)  # output lengths exactly as the dataset says
        if self.endpoint == "chat":
            self.messages.append({"role": "user", "content": turn.text})
            planned = sum(len(m["content"].split()) for m in self.messages)
            return {
                **common,
                "messages": list(self.messages),
                "max_completion_tokens": turn.output_len,
            }, planned
        if turn.prompt_ids is not None:
            prompt = (self.prompt or []) + list(turn.prompt_ids)
            planned = len(prompt)
        else:
            prompt = (self.prompt or "") + turn.text
            planned = len(prompt.split())
        self.prompt = prompt
        return {**common, "prompt": prompt, "max_tokens": turn.output_len}, planned

    def add_reply(self, result: RequestResult) -> None:
        if self.endpoint == "chat":
            self.messages.append({"role": "assistant", "content": result.text})
        elif isinstance(self.prompt, list):
            # A server that streams token ids gives the reply exactly; for one that streams text only
            # (it has a tokenizer), as many of the prompt's ids, seeded, as the reply had tokens.
            reply = result.token_ids or self.rng.choices(self.prompt, k=result.output_tokens)
            self.prompt = self.prompt + reply
        else:
            self.prompt = f"{self.prompt}{result.text}\n"
