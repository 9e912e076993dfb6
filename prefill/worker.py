"""The prefill worker: reserves source envelopes, runs batched prefill, sends whole envelopes.

State contract: `_held` names each request whose source envelope lives here, from its reserve until
its transfer concludes (pinned meanwhile); either way the pool gets every page and slot back before
`prefill_and_send` returns.
"""

from __future__ import annotations

import time

from distpool.memory.pool import DoesNotFit
from distpool.worker.base import TRANSFER_YIELD_S, WorkerBase, byte_runs
from transfer import ChannelError, Transfer, TransferError

# What became of one request (the "outcome" of its result).
SENT, BUSY, FAILED = "sent", "busy", "failed"
YIELD_MAX_S = 1.0  # the longest a batch's prefill waits for the previous batch's transfers


class PrefillWorker(WorkerBase):
    """Plain class; the launcher wraps it with `ray.remote`. Unit tests build it directly."""

    role = "prefill"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._held: dict[str, str] = {}  # request id -> the decode worker it goes to

    def prefill_and_send(self, batch: list[tuple[str, list[int], str, str | None]]) -> dict[str, dict]:
        """Prefill a batch of (request id, prompt, decode worker, injected sender fault or None) and
        send each envelope to its decode worker, with the first token in the transfer header.

        Returns request id -> {"outcome": "sent", "bytes", "seconds", "runs"} (`runs`: the byte runs
        the source envelope sat in) | {"outcome": "busy", "reason"}
        (no room here; retry later) | {"outcome": "failed", "reason", "retry"} (the transfer failed;
        `retry` says whether another pair may succeed). Nothing is held here once it returns.
        """
        deadline = time.monotonic() + YIELD_MAX_S  # the previous batch's transfers move first
        while self.channels.moving() and time.monotonic() < deadline:
            time.sleep(TRANSFER_YIELD_S)
        out: dict[str, dict] = {}
        admitted: list[tuple[str, list[int], str, str | None]] = []
        runs: dict[str, int] = {}
        with self._lock:
            for rid, prompt, peer, fault in batch:
                if rid in self._held:
                    out[rid] = {"outcome": FAILED, "reason": f"{rid!r} is already held here", "retry": False}
                    continue
                try:
                    self.pool.reserve(rid, len(prompt), compact=True)
                except DoesNotFit as exc:
                    out[rid] = {"outcome": BUSY, "reason": exc.reason}
                    continue
                self._held[rid] = peer
                admitted.append((rid, prompt, peer, fault))
            self._note_peak()
            if not admitted:
                return out
            rids = [rid for rid, *_ in admitted]
            try:
                first_tokens = self.model.prefill(self.pool, rids, [prompt for _, prompt, _, _ in admitted])
            except BaseException:
                for rid in rids:
                    self._free(self._held, rid)
                raise
            outgoing = []
            for (rid, _, peer, fault), token in zip(admitted, first_tokens, strict=True):
                try:
                    envelope, ranges = self.pool.envelope(rid), self.pool.envelope_ranges(rid)
                except ValueError as exc:  # e.g. an id no envelope can carry: give it all back
                    self._free(self._held, rid)
                    out[rid] = {"outcome": FAILED, "reason": str(exc), "retry": False}
                    continue
                self.pool.pin(rid)  # compaction may not move it while the transfer reads it
                outgoing.append((rid, peer, fault, int(token), envelope, ranges))
                runs[rid] = byte_runs(ranges)
        transfers: list[tuple[str, Transfer]] = []
        for rid, peer, fault, token, envelope, ranges in outgoing:
            try:
                transfer = self.channels.submit(
                    peer, envelope, self.pool.buffer, ranges, first_token=token, fault=fault
                )
            except ChannelError as exc:  # no channel to that peer (it died): nothing was queued
                self._free(self._held, rid, pinned=True)
                out[rid] = {"outcome": FAILED, "reason": str(exc), "retry": True}
                continue
            transfers.append((rid, transfer))
        for rid, transfer in transfers:
            try:
                transfer.wait()
                self.metrics.add_transfer(transfer.num_bytes, transfer.active_s or 0.0)
                out[rid] = {
                    "outcome": SENT,
                    "bytes": transfer.num_bytes,
                    "seconds": transfer.active_s,
                    "runs": runs[rid],
                }
            except TransferError as exc:
                self.metrics.add_failure(exc.reason)
                out[rid] = {"outcome": FAILED, "reason": exc.reason, "retry": True}
            finally:
                self._free(self._held, rid, pinned=True)
        return out

    def stats(self) -> dict:
        with self._lock:
            return {**super().stats(), "held": len(self._held)}
