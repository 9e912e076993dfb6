"""The prefill worker: reserves source envelopes, runs batched prefill, sends whole envelopes.

State contract: `_held` names each request whose source envelope lives here, from its reserve until
its transfer concludes (pinned meanwhile); either way the pool gets every page and slot back before
`prefill_and_send` returns.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

from distpool.memory.envelope import Envelope
from distpool.model.sampling import pick_for
from distpool.worker.base import WorkerBase, byte_runs
from distpool.worker.lockstep import GroupBroken, wave_signature
from distpool.worker.messages import (
    PrefillBusy,
    PrefillCause,
    PrefillFailed,
    PrefillItem,
    PrefillResult,
    PrefillSent,
)
from distpool.worker.stats import PrefillStats
from prefill.jobs import PrefillWave, split_batch
from transfer import ChannelError, FailureKind, Parts, Transfer, TransferError

YIELD_MAX_S = 1.0  # the longest a batch's prefill waits for the previous batch's transfers


@dataclass(frozen=True)
class _Outgoing:
    """A prefilled request's envelope, pinned until its transfer concludes."""

    rid: str
    peer: str  # the decode worker it goes to
    token: int  # the first generated token, sent in the transfer header
    envelope: Envelope
    computed: int  # prompt tokens prefill computed (after the cached prefix)
    wave_tokens_per_s: float  # its wave's prompt tokens over the model call's seconds


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
        the checkpoint it writes (jobs.py, checkpoints.py). Returns request id -> what became of it
        (`PrefillSent`, `PrefillBusy`: no room here, or `PrefillFailed`). Nothing is held here once
        it returns.
        """
        if self.lockstep is not None and not self.lockstep.bound:
            return self._not_formed(batch)
        self.channels.activity.wait_idle(YIELD_MAX_S)  # the previous batch's transfers move first
        out: dict[str, PrefillResult] = {}
        outgoing: list[_Outgoing] = []
        with self.lock:
            waves = split_batch(self.pool, [item.prompt for item in batch])
            shared = {batch[i].request_id: pages for i, pages in waves.leader_pages.items()}
            try:
                for positions in (waves.first, waves.then):
                    wave = [batch[i] for i in positions]
                    outgoing += self._prefill_wave(wave, shared, out)
            except BaseException as exc:  # the first wave's envelopes are never sent: give them back
                for job in outgoing:
                    self._free(self._held, job.rid, pinned=True)
                if isinstance(exc, GroupBroken):
                    self.group_broken(exc)
                raise
        # One transfer per channel to the decode worker's ranks this rank serves (one at equal TP).
        transfers: list[tuple[_Outgoing, Parts]] = []
        for job in outgoing:
            moving: list[Transfer] = []
            try:
                for peer in self.peer_ranks(job.peer):
                    moving.append(
                        self.channels.submit(peer, job.envelope, self.pool.buffer, first_token=job.token)
                    )
            except ChannelError as exc:  # no channel to a rank of that peer (it died)
                for transfer in moving:  # queued already: concluded before the envelope is freed
                    transfer.abort(f"another channel of {job.rid!r} failed")
                    _concluded(transfer)
                self._free(self._held, job.rid, pinned=True)
                out[job.rid] = PrefillFailed(
                    kind=exc.kind, reason=str(exc), retry=True, cause=PrefillCause.NO_CHANNEL
                )
                continue
            transfers.append((job, Parts(moving)))  # one failing aborts the others
        for job, parts in transfers:
            try:
                parts.wait()  # every part concluded, landed or not: nothing reads the envelope after
                for transfer in parts.transfers:
                    self.metrics.add_transfer(transfer.num_bytes, transfer.active_s or 0.0)
                out[job.rid] = PrefillSent(
                    transfer_bytes=parts.num_bytes,
                    transfer_s=max(t.active_s or 0.0 for t in parts.transfers),
                    source_runs=byte_runs(job.envelope.ranges),
                    computed_tokens=job.computed,
                    compute_tokens_per_s=job.wave_tokens_per_s,
                )
            except TransferError as exc:
                self.metrics.add_failure(exc.kind)
                out[job.rid] = PrefillFailed(
                    kind=exc.kind, reason=exc.reason, retry=True, cause=PrefillCause.TRANSFER
                )
            finally:
                self._free(self._held, job.rid, pinned=True)
        return out

    def _not_formed(self, batch: list[PrefillItem]) -> dict[str, PrefillResult]:
        """A batch for a rank whose TP group has not formed (yet): a call queued for this rank while
        Ray restarted it, or one made before the driver re-formed the group. Nothing is computed or
        held (a collective would pair with nothing), and every request is retried elsewhere."""
        reason = f"{self.name} is starting: its TP group has not formed yet"
        failed = PrefillFailed(
            kind=FailureKind.WORKER_LOST, reason=reason, retry=True, cause=PrefillCause.GROUP_NOT_FORMED
        )
        return {item.request_id: failed for item in batch}

    def _prefill_wave(
        self, items: list[PrefillItem], shared: dict[str, int], out: dict[str, PrefillResult]
    ) -> list[_Outgoing]:
        """Build, prefill and cache one wave (under the lock); its envelopes, pinned for sending.
        `shared[rid]`: the page boundary a leader shares with prompts of the next wave."""
        peers = {item.request_id: item.decode_worker for item in items}
        params = {item.request_id: item.params for item in items}
        fresh: dict[str, list[int]] = {}
        for item in items:
            if item.request_id in self._held:
                reason = f"{item.request_id!r} is already held here"
                out[item.request_id] = PrefillFailed(
                    kind=FailureKind.BAD_REQUEST, reason=reason, retry=False, cause=PrefillCause.ALREADY_HELD
                )
            else:
                fresh[item.request_id] = item.prompt
        wave = PrefillWave.reserve(self.pool, fresh, shared)
        for rid, reason in wave.busy.items():
            out[rid] = PrefillBusy(reason=reason, cause=PrefillCause.NO_ROOM)
        for job in wave.jobs:
            self._held[job.request_id] = peers[job.request_id]
        self._note_peak()
        # Past TP 1 every rank agrees on each wave, empty or not, before any computes it.
        if self.lockstep is not None and not self.lockstep.same(wave_signature(wave.jobs)):
            self._give_back(wave)
            reason = f"the ranks of {self.group} reserved different waves"
            for job in wave.jobs:  # e.g. one rank's prefix cache matched, another's had evicted it
                out[job.request_id] = PrefillBusy(reason=reason, cause=PrefillCause.WAVES_DIFFER)
            return []
        if not wave.jobs:
            return []
        started = time.monotonic()
        try:
            eos = self.config.eos_token_ids  # the first token is picked here, its draw index 0
            jobs = [replace(job, pick=pick_for(params[job.request_id], eos, 0)) for job in wave.jobs]
            done = self.model.prefill(self.pool, jobs)
        except BaseException:
            self._give_back(wave)
            raise
        compute_s = time.monotonic() - started
        wave.cache()
        computed = sum(result.computed_tokens for result in done)
        rate = computed / compute_s if computed and compute_s > 0 else 0.0
        outgoing = []
        for result in done:
            rid = result.request_id
            try:
                envelope = self.pool.envelope(rid)
            except ValueError as exc:  # e.g. an id no envelope can carry: give it all back
                self._free(self._held, rid)
                out[rid] = PrefillFailed(
                    kind=FailureKind.BAD_REQUEST, reason=str(exc), retry=False, cause=PrefillCause.NO_ENVELOPE
                )
                continue
            self.pool.pin(rid)  # compaction may not move it while the transfer reads it
            outgoing.append(
                _Outgoing(rid, peers[rid], result.first_token, envelope, result.computed_tokens, rate)
            )
        return outgoing

    def _give_back(self, wave: PrefillWave) -> None:
        """Under the lock: a wave not computed gives back its checkpoints and its requests' memory."""
        wave.discard()
        for job in wave.jobs:
            self._free(self._held, job.request_id)

    def stats(self) -> PrefillStats:
        with self.lock:
            return PrefillStats(**asdict(super().stats()), held=len(self._held))


def _concluded(transfer: Transfer) -> None:
    """Wait for `transfer` to conclude (an aborted one does within its deadline), however it ended."""
    try:
        transfer.wait()
    except TransferError:
        pass
