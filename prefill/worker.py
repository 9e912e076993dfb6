"""The prefill worker: reserves source envelopes, runs batched prefill, sends whole envelopes.

State contract: `_held` maps each request whose source envelope lives here to its first token. An
envelope stays held (and pinned while it is being sent) until `send` concludes or `drop` is called;
either way the pool gets every page and slot back.
"""

from __future__ import annotations

from distpool.allocator import NeedsCompaction
from distpool.envelope import Envelope
from distpool.pool import DoesNotFit
from distpool.worker_base import WorkerBase


class PrefillWorker(WorkerBase):
    """Plain class; the launcher wraps it with `ray.remote`. Unit tests build it directly."""

    role = "prefill"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._held: dict[str, int] = {}

    def prefill(self, requests: list[tuple[str, list[int]]]) -> dict[str, int | str]:
        """Prefill a batch. Returns request id -> first token, or -> an error text for a request that
        could not be admitted (it holds nothing). Admitted requests stay held until `send` / `drop`."""
        admitted: list[tuple[str, list[int]]] = []
        out: dict[str, int | str] = {}
        with self._lock:
            for rid, prompt in requests:
                if rid in self._held:
                    out[rid] = f"request {rid!r} is already held by {self.name}"
                    continue
                try:
                    self._reserve(rid, len(prompt))
                    admitted.append((rid, prompt))
                except DoesNotFit as exc:
                    out[rid] = str(exc)
            if admitted:
                rids = [rid for rid, _ in admitted]
                try:
                    first = self.model.prefill(self.pool, rids, [p for _, p in admitted])
                except BaseException:
                    for rid in rids:
                        self.pool.release(rid)
                    raise
                for rid, token in zip(rids, first, strict=True):
                    self._held[rid] = int(token)
                    out[rid] = int(token)
        return out

    def _reserve(self, rid: str, num_tokens: int) -> None:
        try:
            self.pool.reserve(rid, num_tokens)
        except NeedsCompaction:
            self.pool.compact()
            self.pool.reserve(rid, num_tokens)
        self._note_peak()

    def send(
        self, request_id: str, peer: str, destination: bytes, fault_after_chunks: int | None = None
    ) -> dict:
        """Send the held envelope to `peer`, into the destination envelope it reserved (`destination`
        is its encoded Envelope). The source is freed whatever the outcome."""
        envelope, ranges = self._pin_envelope(self._held, request_id)
        try:
            dst = Envelope.decode(destination)
            if dst.request_id != request_id:
                raise ValueError(f"destination envelope is for {dst.request_id!r}, not {request_id!r}")
            return self.channels.send(peer, envelope, self.pool.arena, ranges, fault_after_chunks)
        finally:
            self._free(self._held, request_id, pinned=True)

    def drop(self, request_id: str) -> bool:
        """Free a held request that will not be sent. Returns whether anything was freed."""
        return self._free(self._held, request_id)

    def stats(self) -> dict:
        with self._lock:
            return {**super().stats(), "held": len(self._held)}
