"""What a decode worker hands its driver: the requests that ended, the tokens made since the last
hand-out, and what its prefix cache cached and evicted. The driver keeps one `next_events` call
outstanding per decode worker, so all three reach it as they happen, with no polling interval.

State contract: guarded by the worker's lock, whose condition (`wake`) is notified whenever any of
it changes. `finished` holds a request from the moment it ended (finished or failed, its memory
given back) until `next_events` hands it out, once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from decode.request import DecodeRequest
from distpool.memory.prefix import CacheNews, PrefixCache
from distpool.worker.messages import DecodeEvents

# Tokens made within this long of the last hand-out go out together, and a request waiting for its
# envelope is looked at this often for its header's first token.
STREAM_INTERVAL_S = 0.02
HEADER_LOOK_S = 0.01

Streaming = Callable[[], Iterable[tuple[str, DecodeRequest]]]


class Outbox:
    """The news of one decode worker. `streaming()`: (request id, request) of every request whose
    tokens may stream; `waiting()`: whether a request waits for its envelope (its header's first
    token lands without waking anyone); `stopping()`: whether the worker's loop is ending."""

    def __init__(
        self,
        wake: threading.Condition,
        cache: PrefixCache | None,
        eos_token_ids: tuple[int, ...],
        *,
        streaming: Streaming,
        waiting: Callable[[], bool],
        stopping: Callable[[], bool],
    ) -> None:
        self.wake, self.cache, self.eos_token_ids = wake, cache, eos_token_ids
        self._streaming, self._waiting, self._stopping = streaming, waiting, stopping
        self.finished: dict[str, DecodeRequest] = {}
        self._streamed_at = 0.0  # when `next_events` last handed out tokens
        if cache is not None:
            cache.report_changes()  # `next_events` hands the news to the driver

    def hand_out(self, request_id: str, req: DecodeRequest) -> None:
        """Under the lock: `req` ended; the next `next_events` hands it out."""
        self.finished[request_id] = req
        self.wake.notify_all()

    def news_of_cache(self) -> bool:
        """Under the lock: whether the cache cached or evicted anything not yet handed out."""
        return self.cache is not None and self.cache.has_news

    def next_events(self, timeout_s: float, stream: bool) -> DecodeEvents:
        """Wait up to `timeout_s` for news (the caller does not hold the lock): requests that ended
        (each handed out once, `DecodeRequest.result`), the cache's news, and with `stream` tokens made
        since the last call (a request's first as soon as its transfer header landed). News of tokens
        alone waits until STREAM_INTERVAL_S after the last call that handed some out, so that fast
        steps go out together."""
        deadline = time.monotonic() + timeout_s
        with self.wake:
            while not self.finished and not self.news_of_cache() and not self._stopping():
                now = time.monotonic()
                if now >= deadline:
                    break
                if stream and self._has_unstreamed():
                    ready_at = self._streamed_at + STREAM_INTERVAL_S
                    if now >= ready_at:
                        break
                    self.wake.wait(min(ready_at, deadline) - now)
                elif stream and self._waiting():  # a header may land without waking anyone: look again soon
                    self.wake.wait(min(HEADER_LOOK_S, deadline - now))
                else:
                    self.wake.wait(deadline - now)
            done, self.finished = self.finished, {}
            tokens = self._take_unstreamed() if stream else {}
            if tokens:
                self._streamed_at = time.monotonic()
            news = self.cache.take_news() if self.cache is not None else CacheNews()
        finished = {rid: req.result() for rid, req in done.items()}
        return DecodeEvents(finished=finished, tokens=tokens, cache=news)

    def _has_unstreamed(self) -> bool:
        eos = self.eos_token_ids
        return any(len(req.streamable(eos)) > req.streamed for _, req in self._streaming())

    def _take_unstreamed(self) -> dict[str, tuple[int, list[int]]]:
        news = ((rid, req.unstreamed(self.eos_token_ids)) for rid, req in self._streaming())
        return {rid: new for rid, new in news if new is not None}
