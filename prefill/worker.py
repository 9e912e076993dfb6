"""The prefill worker: reserves source envelopes, runs batched prefill, sends whole envelopes.

State contract: `_held` names each request whose source envelope lives here, from its reserve until
its transfer concludes (pinned meanwhile); either way the pool gets every page and slot back before
`prefill_and_send` returns.
"""

from __future__ import annotations

import time

from distpool.memory.pool import DoesNotFit
from distpool.memory.prefix_index import PrefixMatch
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
        cache = self.pool.prefix_cache
        matches: dict[str, PrefixMatch] = {}
        with self._lock:
            for rid, prompt, peer, fault in batch:
                if rid in self._held:
                    out[rid] = {"outcome": FAILED, "reason": f"{rid!r} is already held here", "retry": False}
                    continue
                match = cache.match(prompt) if cache is not None else None
                try:
                    self.pool.reserve(rid, len(prompt), compact=True, prefix=match)
                except DoesNotFit as exc:
                    out[rid] = {"outcome": BUSY, "reason": exc.reason}
                    continue
                self._held[rid] = peer
                admitted.append((rid, prompt, peer, fault))
                if match is not None:
                    matches[rid] = match
            self._note_peak()
            if not admitted:
                return out
            rids = [rid for rid, *_ in admitted]
            prompts = [prompt for _, prompt, _, _ in admitted]
            snapshots = self._snapshots(rids, prompts, matches)
            try:
                first_tokens = self.model.prefill(
                    self.pool,
                    rids,
                    prompts,
                    cached=[matches[rid].num_tokens if rid in matches else 0 for rid in rids],
                    checkpoints=[self._checkpoint_slot(matches.get(rid)) for rid in rids],
                    snapshots=[snap[:2] if snap else None for snap in snapshots],
                )
            except BaseException:
                if cache is not None:
                    cache.discard_checkpoints([snap[2] for snap in snapshots if snap])
                for rid in rids:
                    self._free(self._held, rid)
                raise
            computed = dict(zip(rids, self.model.last_prefill_computed, strict=True))
            self._cache_prompts(rids, prompts, snapshots)
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
                    "computed_tokens": computed[rid],  # the prompt's tokens after its cached prefix
                }
            except TransferError as exc:
                self.metrics.add_failure(exc.reason)
                out[rid] = {"outcome": FAILED, "reason": exc.reason, "retry": True}
            finally:
                self._free(self._held, rid, pinned=True)
        return out

    def _snapshots(
        self, rids: list[str], prompts: list[list[int]], matches: dict[str, PrefixMatch]
    ) -> list[tuple[int, int, int] | None]:
        """Per request, where its prefill writes a state checkpoint for the prefix cache: (depth,
        physical slot, checkpoint handle) at its last full page boundary past its cached prefix,
        or None (no cache, no recurrent state, no new boundary, or no room for one)."""
        cache = self.pool.prefix_cache
        out = []
        for rid, prompt in zip(rids, prompts, strict=True):
            depth = len(prompt) // self.pool.page_size
            cached = len(matches[rid].pages) if rid in matches else 0
            if cache is None or not cache.needs_checkpoint or depth <= cached:
                out.append(None)
                continue
            try:
                handle, slot = cache.take_checkpoint()
            except DoesNotFit:  # no room for one: this prompt is cached without a checkpoint
                out.append(None)
                continue
            out.append((depth, slot, handle))
        return out

    def _checkpoint_slot(self, match: PrefixMatch | None) -> int | None:
        """Physical slot of the checkpoint a match starts from (None: no match or no state)."""
        if match is None or match.checkpoint is None:
            return None
        return self.pool.prefix_cache.checkpoint_slot(match.checkpoint)  # a match implies a cache

    def _cache_prompts(self, rids: list[str], prompts: list[list[int]], snapshots: list) -> None:
        """Offer each prompt's full pages (and its new checkpoint) to the prefix cache."""
        cache = self.pool.prefix_cache
        if cache is None:
            return
        for rid, prompt, snap in zip(rids, prompts, snapshots, strict=True):
            cache.cache_request(rid, prompt, {snap[0]: snap[2]} if snap else None)

    def stats(self) -> dict:
        with self._lock:
            return {**super().stats(), "held": len(self._held)}
