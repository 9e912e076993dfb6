"""Calling the front end's ASGI app in process: httpx's ASGI transport for whole answers, and a raw
ASGI call for what httpx cannot do in process (a client that disconnects part-way)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx


def client(app, api_key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front", headers=headers)


@dataclass
class RawCall:
    """One request whose client can leave: `leave` set -> the app's next receive is a disconnect."""

    app: object
    path: str
    body: bytes
    leave: asyncio.Event = field(default_factory=asyncio.Event)
    status: int | None = None
    chunks: list[bytes] = field(default_factory=list)
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body_parts: int = 1  # the body sent in this many messages, without a content-length

    async def run(self) -> None:
        parts = _split(self.body, self.body_parts)
        sent = 0

        async def receive() -> dict:
            nonlocal sent
            if sent < len(parts):
                sent += 1
                return {"type": "http.request", "body": parts[sent - 1], "more_body": sent < len(parts)}
            await self.leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
            elif message["type"] == "http.response.body" and message.get("body"):
                self.chunks.append(message["body"])

        headers = [(b"content-type", b"application/json"), *self.headers]
        if self.body_parts == 1:
            headers.append((b"content-length", str(len(self.body)).encode()))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 5000),
            "server": ("front", 80),
        }
        await self.app(scope, receive, send)


def _split(body: bytes, parts: int) -> list[bytes]:
    size = max(1, -(-len(body) // parts))
    return [body[i : i + size] for i in range(0, len(body), size)] or [b""]


def raw_call(app, path: str, payload: dict | bytes, **kwargs) -> RawCall:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return RawCall(app=app, path=path, body=body, **kwargs)


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("the condition did not hold in time")
        await asyncio.sleep(0.005)
