"""The sending end (rank 0, the prefill worker): a queue of envelopes moved one after another.

`EnvelopeSender.submit` returns a `Transfer` at once; a worker thread runs the transfers on the
channel in submission order. A prefill rank of a TP group submits its own envelope (`Pool.envelope`
of its shard's pool) on each of its channels, or all at once with `transfer.parts.submit_parts`;
each channel sends only the part its destination rank needs (`Channel.tp_pair`). One transfer:

    the receiver offered its destination already (OFFER: its table, and how many leading pages it
        holds) and the envelope pairs with it: plan on it, ring the bell with the HEADER (source
        table, first token, the offer's serial) and go on at once
    else ring the bell with a HEADER planned on no offer; wait READY (the same facts as an OFFER)
        | REFUSE; none by the deadline: withdraw the header (see `_await_reply`)
    plan runs and messages from both tables, less the held pages (the receiver computes the same plan)
    for each chunk k: start gathering chunk k+1, then send chunk k's messages
        (`transfer.ends.send_pipeline`: the gather of chunk k+1 overlaps the send of chunk k)
    send the trailer (filled, + checksum), and after an abort ABORT; wait STATUS (which, for a
        header planned on an offer, may say the receiver refused it: it discarded the payload)

A receiver that fails mid-stream tears its group down and leaves a STATUS marked broken. Over
Gloo the closed link fails the next send at once; NCCL sends to an aborted peer stay pending, so
there the sender learns it from STATUS once its sends are done, or at its deadline.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from distpool.memory.envelope import Envelope
from transfer.ends.activity import Activity
from transfer.ends.end import ChannelEnd, Job, Stopped
from transfer.ends.handle import ChunkHook, Transfer, TransferOptions
from transfer.ends.offer_check import paired_runs, planned_on_offer, reply_bytes
from transfer.ends.send_pipeline import SendPipeline
from transfer.ends.staging import checksum
from transfer.pair import SENDER_RANK, Channel
from transfer.plans import NBYTES, SRC, MessagePlan
from transfer.wire import (
    ABORT,
    HEADER,
    PROTOCOL_VERSION,
    READY,
    REFUSE,
    STATUS,
    WITHDRAWN,
    ChannelError,
    FailureKind,
    HeaderRefused,
    ProtocolError,
    TransferError,
    abort_key,
    encode_message,
    offer_key,
    reply_key,
    status_key,
    table_bytes,
    trailer,
    withdraw_key,
)


def refused(request_id: str, kind: FailureKind, problem: str, reason: str) -> TransferError:
    """The error of a transfer whose header the receiver refused (REFUSE, or STATUS after an offer)."""
    refusal = HeaderRefused(kind, problem, reason)
    return TransferError(request_id, kind, f"receiver refused: {refusal.detail}", cause=refusal)


class EnvelopeSender(ChannelEnd):
    """Moves envelopes over one channel (rank 0), in submission order, on its own thread."""

    role = "sender"

    def __init__(
        self, channel: Channel, options: TransferOptions | None = None, *, activity: Activity | None = None
    ) -> None:
        self.options = options or TransferOptions()
        self._queue: collections.deque[Job] = collections.deque()
        super().__init__(channel, SENDER_RANK, activity)
        # CPU gathers run on their own thread so that they overlap a send the worker thread writes.
        self._gatherer = (
            ThreadPoolExecutor(1, thread_name_prefix=f"gather-{channel.name}")
            if channel.device.type == "cpu"
            else None
        )

    def submit(
        self,
        envelope: Envelope,
        buffer: torch.Tensor,
        *,
        first_token: int = 0,
        deadline_s: float | None = None,
        on_chunk: ChunkHook | None = None,
    ) -> Transfer:
        """Queue `envelope` (its bytes at `envelope.ranges` in `buffer`) for sending, with the
        token prefill produced (`first_token`, carried in the header). The deadline defaults to the
        options' timeout. Raises ValueError for arguments that cannot describe an envelope in this
        buffer; every other failure concludes the returned transfer as FAILED.
        """
        job = self.new_job(
            envelope,
            buffer,
            deadline_s=deadline_s or self.options.timeout_s,
            on_chunk=on_chunk,
            on_expire=self._expire,  # a queued transfer fails at its deadline or abort, not later
            first_token=first_token,
        )
        with self.cond:
            if self.closed:
                job.transfer.conclude(
                    TransferError(envelope.request_id, FailureKind.ABORTED, "the sender is closed")
                )
            else:
                self._queue.append(job)
                self.cond.notify_all()
        return job.transfer

    def close(self, kind: FailureKind = FailureKind.ABORTED) -> None:
        super().close(kind)
        if self._gatherer is not None:
            self._gatherer.shutdown(wait=True)

    def drop_pending(self) -> list[Job]:
        queued, self._queue = list(self._queue), collections.deque()
        return queued

    def _expire(self, transfer: Transfer) -> None:
        """Fail a transfer still queued (deadline passed or aborted); once taken, the worker concludes it."""
        with self.cond:
            job = next((j for j in self._queue if j.transfer is transfer), None)
            if job is None:
                return
            self._queue.remove(job)
        transfer.conclude(transfer.unstarted_error("the deadline passed while queued behind other transfers"))

    @property
    def _direct_min_bytes(self) -> int:
        return self.options.direct_min_bytes_for(self.channel.device)

    # ---- worker ----------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            with self.cond:
                while not self._queue and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                job = self._queue.popleft()
                # A broken channel holds the queue until the owner rebuilds it or the deadline passes.
                while (
                    not self.channel.healthy and not self.closed and time.monotonic() < job.transfer.deadline
                ):
                    self.cond.wait(min(0.05, max(job.transfer.deadline - time.monotonic(), 0.0)))
            transfer, channel = job.transfer, self.channel
            if transfer.abort_reason is not None:
                transfer.conclude(
                    TransferError(transfer.request_id, FailureKind.ABORTED, transfer.abort_reason)
                )
            elif time.monotonic() >= transfer.deadline:
                state = channel.broken_reason or "busy"
                reason = f"deadline passed before the transfer started (channel: {state})"
                transfer.conclude(TransferError(transfer.request_id, FailureKind.TIMEOUT, reason))
            elif not channel.healthy:
                reason = f"channel down: {channel.broken_reason}"
                error = TransferError(transfer.request_id, FailureKind.PEER_LOST, reason, channel_broken=True)
                transfer.conclude(error)
            else:
                with self.io_lock:
                    self.conclude(transfer.request_id, job, lambda job=job: self._send_one(job), unread=[])

    def _send_one(self, job: Job) -> None:
        channel, transfer, options = self.channel, job.transfer, self.options
        self.stream.wait_for(job.ready)
        offer = planned_on_offer(channel, job, options.chunk_bytes)  # None: the header waits for READY
        header = encode_message(
            HEADER,
            version=PROTOCOL_VERSION,
            seq=channel.transfer_seq,
            request_id=transfer.request_id,
            num_tokens=job.envelope.num_tokens,
            first_token=transfer.first_token or 0,
            table=table_bytes(job.envelope.ranges),
            chunk_bytes=options.chunk_bytes,
            direct_min_bytes=self._direct_min_bytes,
            checksum=options.checksum,
            offer=0 if offer is None else offer[0],
        )
        seq = channel.ring_bell(header)
        if offer is not None:  # the receiver takes the payload, or discards it and says why in STATUS
            runs = offer[1]
            transfer.begin()
            deadline = transfer.deadline
        else:
            try:
                runs, deadline = self._await_reply(job, seq)
            finally:  # an offer filed before the answer (the control link keeps order) was for this header
                self._drop_offer(transfer.request_id)
            if not transfer.done():  # else failed already: a READY that crossed its withdrawal
                transfer.begin()
                deadline = transfer.deadline
        self._send_chunks(job, seq, runs, deadline)

    def _drop_offer(self, request_id: str) -> None:
        """Forget the receiver's offer for `request_id`, if one came: left, a later transfer of the
        request would plan on it, and be refused."""
        try:
            self.channel.control.take_offer(offer_key(request_id))
        except ChannelError:  # the link went with its offers
            pass

    def _await_reply(self, job: Job, seq: int) -> tuple[np.ndarray, float]:
        """Wait for READY (return the plan's runs, and the deadline to move them by) or REFUSE
        (raise TransferError).

        No answer by the deadline: the transfer fails then, and the header is withdrawn. The
        receiver answers a withdrawal it sees in time with REFUSE; until an answer comes this end
        waits (at most the channel's timeout, holding no memory of the failed transfer), so that the
        channel stays in step. A READY that crossed the withdrawal is answered as an abort: the
        stream goes out as after one (nothing gathered; runs sent straight from the arena carry
        whatever it holds now, which the receiver discards), then ABORT, within a fresh timeout.
        No answer at all breaks the channel.
        """
        channel, transfer = self.channel, job.transfer
        key = reply_key(seq)
        with self.io_lock.waiting():  # for the receiver's reservation, perhaps: nothing moves
            blob = channel.control.wait_value(key, transfer.deadline - time.monotonic())
        deadline = transfer.deadline
        if blob is None:
            reason = "the receiver did not answer the header before the deadline"
            channel.control.send(withdraw_key(seq), encode_message(WITHDRAWN, seq=seq, reason=reason))
            transfer.abort("the sender withdrew the transfer (its deadline passed)")
            transfer.conclude(TransferError(transfer.request_id, FailureKind.TIMEOUT, reason))
            blob = channel.control.wait_value(key, channel.timeout_s)
            if blob is None:
                withdrawal = f"{reason}, nor its withdrawal within {channel.timeout_s:.1f} s"
                raise ChannelError(withdrawal, kind=FailureKind.TIMEOUT)
            deadline = time.monotonic() + channel.timeout_s
        reply = self.read_message(blob, seq, expect=(READY, REFUSE), max_bytes=reply_bytes(job))
        if reply["kind"] == REFUSE:  # the protocol checked the kind and the problem
            raise refused(
                transfer.request_id, FailureKind(reply["failure"]), reply["problem"], reply["reason"]
            )
        try:
            runs = paired_runs(channel, job, reply["table"], reply["held"])
        except ValueError as exc:
            raise ProtocolError(f"the receiver's table does not pair with ours: {exc}") from None
        return runs, deadline

    def _send_chunks(self, job: Job, seq: int, runs: np.ndarray, deadline: float) -> None:
        channel, transfer = self.channel, job.transfer
        chunks = MessagePlan(
            runs,
            chunk_bytes=self.options.chunk_bytes,
            direct_min_bytes=self._direct_min_bytes,
            num_streams=channel.num_streams,
        )
        pipeline = SendPipeline(channel, self.staging, self._gatherer, job, chunks)
        pipeline.send(deadline)
        aborted = transfer.abort_reason
        value = None
        if aborted is None and self.options.checksum:
            value = checksum(job.buffer, runs[:, SRC], runs[:, NBYTES])
        pipeline.post_trailer(trailer(seq, filled=aborted is None, checksum=value, device=channel.device))
        if aborted is not None:
            # Failed already (its deadline passed before the READY came): the ABORT says as what.
            kind = transfer.error.kind if transfer.error is not None else FailureKind.ABORTED
            message = encode_message(ABORT, seq=seq, failure=kind, reason=aborted)
            channel.control.send(abort_key(seq), message)  # read once the trailer says unfilled
        if (first := pipeline.first_send()) is not None:  # every send posted, the trailer too
            self._await_taken(first, deadline)
        pipeline.drain(deadline)
        try:
            self._await_status(job, seq, deadline)
        finally:
            if channel.healthy:  # the receiver read the trailer before it sent its STATUS
                pipeline.drain_trailer(deadline)
        if aborted is not None:
            raise Stopped(FailureKind.ABORTED, aborted)

    def _await_taken(self, work: object, deadline: float) -> None:
        """Wait until the receiver took the stream's first message. Planned on an offer, the payload
        follows the header at once, and nothing moves until the receiver has read the header and
        posted its receives (a decode worker busy with a step may take a while): meanwhile this end
        counts as waiting, so that its worker's model work need not wait for it."""
        with self.io_lock.waiting():
            self.channel.wait(work, deadline, "sending the first message")

    def _await_status(self, job: Job, seq: int, deadline: float) -> None:
        channel, rid = self.channel, job.transfer.request_id
        status = self.await_message(
            status_key(seq),
            seq,
            expect=(STATUS,),
            timeout_s=deadline - time.monotonic(),
            max_bytes=4096,
        )
        if status is None:
            reason = "the receiver sent no status before the deadline"
            channel.mark_broken(reason)
            raise TransferError(rid, FailureKind.TIMEOUT, reason, channel_broken=True)
        if status["ok"]:
            return
        kind, reason = FailureKind(status["failure"]), status["reason"]  # the protocol checked both
        if status["problem"]:  # a header planned on an offer, refused: the payload was discarded
            raise refused(rid, kind, status["problem"], reason)
        if status["broken"]:
            channel.mark_broken(f"the receiver tore the channel down: {reason}")
            raise TransferError(rid, kind, f"receiver failed: {reason}", channel_broken=True)
        if job.transfer.abort_reason is None:
            raise TransferError(rid, kind, f"receiver failed: {reason}")
