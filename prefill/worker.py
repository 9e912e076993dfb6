"""The prefill worker: reserves source envelopes, runs batched prefill, sends whole envelopes.

State contract: `_held` names each request whose source envelope lives here, from its reserve until
its transfer concludes (pinned meanwhile); either way the pool gets every page and slot back before
`prefill_and_send` returns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from distpool.memory.envelope import Envelope
from distpool.memory.pool import DoesNotFit
from distpool.memory.prefix_index import PrefixMatch
from distpool.worker.base import WorkerBase, byte_runs
from distpool.worker.messages import PrefillBusy, PrefillFailed, PrefillItem, PrefillResult, PrefillSent
from distpool.worker.stats import PrefillStats
from prefill.checkpoints import Waves, checkpoint_depth, split_waves
from transfer import ChannelError, FailureKind, Transfer, TransferError

YIELD_MAX_S = 1.0  # the longest a batch's prefill waits for the previous batch's transfers


@dataclass(frozen=True)
class _Outgoing:
    """A prefilled request's envelope, pinned until its transfer concludes."""

    rid: str
    peer: str  # the decode worker it goes to
    token: int  # the first generated token, sent in the transfer header
    envelope: Envelope
    ranges: torch.Tensor  # (num_runs, 2) int64: offset and bytes of each byte run in the arena
    computed: int  # prompt tokens prefill computed (after the cached prefix)


class PrefillWorker(WorkerBase):
    """Plain class; the launcher wraps it with `ray.remote`. Unit tests build it directly."""

    role = "prefill"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._held: dict[str, str] = {}  # request id -> the decode worker it goes to

    def prefill_and_send(self, batch: list[PrefillItem]) -> dict[str, PrefillResult]:
        """Prefill a batch and send each envelope to its decode worker, with the first token in the
        transfer header.

        Prompts that share a prefix with an earlier one of the batch are prefilled after it, from
        the checkpoint it writes (checkpoints.py). Returns request id -> what became of it
        (`PrefillSent`, `PrefillBusy`: no room here, or `PrefillFailed`). Nothing is held here once
        it returns.
        """
        self.channels.activity.wait_idle(YIELD_MAX_S)  # the previous batch's transfers move first
        out: dict[str, PrefillResult] = {}
        outgoing: list[_Outgoing] = []
        with self._lock:
            waves = self._waves(batch)
            try:
                for positions in (waves.first, waves.then):
                    wave = [batch[i] for i in positions]
                    shared = [waves.leader_pages.get(i) for i in positions]
                    outgoing += self._prefill_wave(wave, shared, out)
            except BaseException:  # the first wave's envelopes are never sent: give them back
                for job in outgoing:
                    self._free(self._held, job.rid, pinned=True)
                raise
        transfers: list[tuple[_Outgoing, Transfer]] = []
        for job in outgoing:
            try:
                transfer = self.channels.submit(
                    job.peer,
                    job.envelope,
                    self.pool.buffer,
                    job.ranges,
                    first_token=job.token,
                )
            except ChannelError as exc:  # no channel to that peer (it died): nothing was queued
                self._free(self._held, job.rid, pinned=True)
                out[job.rid] = PrefillFailed(kind=exc.kind, reason=str(exc), retry=True)
                continue
            transfers.append((job, transfer))
        for job, transfer in transfers:
            try:
                transfer.wait()
                transfer_s = transfer.active_s or 0.0
                self.metrics.add_transfer(transfer.num_bytes, transfer_s)
                out[job.rid] = PrefillSent(
                    transfer_bytes=transfer.num_bytes,
                    transfer_s=transfer_s,
                    source_runs=byte_runs(job.ranges),
                    computed_tokens=job.computed,
                )
            except TransferError as exc:
                self.metrics.add_failure(exc.kind)
                out[job.rid] = PrefillFailed(kind=exc.kind, reason=exc.reason, retry=True)
            finally:
                self._free(self._held, job.rid, pinned=True)
        return out

    def _waves(self, batch: list[PrefillItem]) -> Waves:
        """The batch in two waves: prompts that share pages with an earlier one wait for it."""
        cache = self.pool.prefix_cache
        if cache is None or len(batch) < 2:
            return Waves(first=list(range(len(batch))))
        matched = [len(cache.match(item.prompt).pages) for item in batch]
        return split_waves([item.prompt for item in batch], matched, self.pool.page_size)

    def _prefill_wave(
        self, wave: list[PrefillItem], shared: list[int | None], out: dict[str, PrefillResult]
    ) -> list[_Outgoing]:
        """Reserve, prefill and cache one wave (under the lock); its envelopes, pinned for sending.
        `shared[i]`: the boundary request i shares with prompts of a later wave (None: none)."""
        cache = self.pool.prefix_cache
        admitted: list[PrefillItem] = []
        matches: dict[str, PrefixMatch] = {}
        leaders: dict[str, int] = {}
        for item, pages in zip(wave, shared, strict=True):
            rid = item.request_id
            if rid in self._held:
                reason = f"{rid!r} is already held here"
                out[rid] = PrefillFailed(kind=FailureKind.BAD_REQUEST, reason=reason, retry=False)
                continue
            match = cache.match(item.prompt) if cache is not None else None
            try:
                self.pool.reserve(rid, len(item.prompt), compact=True, prefix=match)
            except DoesNotFit as exc:
                out[rid] = PrefillBusy(reason=exc.reason)
                continue
            self._held[rid] = item.decode_worker
            admitted.append(item)
            if match is not None:
                matches[rid] = match
            if pages is not None:
                leaders[rid] = pages
        self._note_peak()
        if not admitted:
            return []
        rids = [item.request_id for item in admitted]
        prompts = [item.prompt for item in admitted]
        snapshots = self._snapshots(rids, prompts, matches, leaders)
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
        for item, token in zip(admitted, first_tokens, strict=True):
            rid = item.request_id
            try:
                envelope, ranges = self.pool.envelope(rid), self.pool.envelope_ranges(rid)
            except ValueError as exc:  # e.g. an id no envelope can carry: give it all back
                self._free(self._held, rid)
                out[rid] = PrefillFailed(kind=FailureKind.BAD_REQUEST, reason=str(exc), retry=False)
                continue
            self.pool.pin(rid)  # compaction may not move it while the transfer reads it
            outgoing.append(_Outgoing(rid, item.decode_worker, int(token), envelope, ranges, computed[rid]))
        return outgoing

    def _snapshots(
        self,
        rids: list[str],
        prompts: list[list[int]],
        matches: dict[str, PrefixMatch],
        leaders: dict[str, int],
    ) -> list[tuple[int, int, int] | None]:
        """Per request, where its prefill writes a state checkpoint for the prefix cache: (depth,
        physical slot, checkpoint handle) at the boundary `checkpoint_depth` picks (the pages it
        shares with later prompts of its batch, `leaders`, else where it leaves a cached path),
        or None (no cache, no recurrent state, no boundary past its match, or no room for one)."""
        cache = self.pool.prefix_cache
        out = []
        for rid, prompt in zip(rids, prompts, strict=True):
            if cache is None or not cache.needs_checkpoint:
                out.append(None)
                continue
            matched = len(matches[rid].pages) if rid in matches else 0
            shared = leaders[rid] if rid in leaders else cache.branch_depth(prompt)
            depth = checkpoint_depth(len(prompt), self.pool.page_size, matched, shared)
            if depth is None:
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

    def stats(self) -> PrefillStats:
        with self._lock:
            return PrefillStats(**asdict(super().stats()), held=len(self._held))
