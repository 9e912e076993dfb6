"""The receiving end (rank 1, the decode worker): envelopes land only where it reserved them.

`EnvelopeReceiver.expect` registers a reserved destination envelope, offers it to the sender
(OFFER: its table, held pages, tokens, rows and chunk limit) and returns a `Transfer`; a worker
thread waits for the sender's bell, then for the transfer it announces. A decode rank of a
TP group expects its own envelope on each of its channels (one per source rank its shard needs),
or on all at once with `transfer.parts.expect_parts`: each channel's transfer concludes when its
part has landed (its `num_bytes` is that part), and the request has landed on the rank when every
part has (`Parts.wait()`). One transfer:

    decode the bell's HEADER (bounded); take the expectation it names (waiting up to
        `unexpected_wait_s` for `expect`)
    check it against the reservation (`transfer.ends.header_check`): request id, tokens, row count
        and row sizes (the source table, less the pages held here already, must pair with ours;
        across TP sizes each row must have the source shard's unit size), chunk size; any mismatch
        -> REFUSE naming the problem (`HeaderRefused`), nothing written
    the sender withdrew it meanwhile -> REFUSE
    READY + our table + how many leading pages we hold (the sender skips them); receive the chunks
        (`transfer.ends.receive_pipeline`: chunk k is scattered while k+1 and k+2 arrive)
    a header planned on our offer gets no answer: its payload follows it. Accepted, it is received
        as above; refused (the reservation went, or a later offer replaced that one), it is
        received into staging and discarded (planned on the offer, which this end remembers), and
        STATUS names the refusal. A payload this end cannot plan breaks the channel.
    the stream's trailer: filled -> verify the checksum (if asked), STATUS ok | unfilled: read
        the sender's ABORT, STATUS failed

Where bytes go is computed from this end's own ranges alone; the header only has to agree.
"""

from __future__ import annotations

import collections
import time

import torch

from distpool.memory.envelope import MAX_PAGES, Envelope
from transfer.defaults import (
    EXPECT_WAIT_S,
    IDLE_WAIT_S,
    MAX_CHUNK_BYTES,
    MAX_REFUSALS_KEPT,
    TELL_PEER_S,
    UNEXPECTED_WAIT_S,
)
from transfer.ends.activity import Activity
from transfer.ends.end import ChannelEnd, Job, Stopped
from transfer.ends.handle import ChunkHook, Transfer
from transfer.ends.header_check import check_header, header_runs, out_of_limits
from transfer.ends.offers import OffersMade
from transfer.ends.receive_pipeline import discard_payload, receive_payload
from transfer.pair import RECEIVER_RANK, Channel
from transfer.wire import (
    HEADER,
    MALFORMED_HEADER,
    NOT_EXPECTED,
    OFFER_STALE,
    READY,
    REFUSE,
    SENDER_WITHDREW,
    STATUS,
    TURNED_AWAY,
    AlreadyExpected,
    ChannelError,
    FailureKind,
    HeaderRefused,
    ProtocolError,
    TransferError,
    decode_message,
    encode_message,
    reply_key,
    status_key,
    table_bytes,
    withdraw_key,
)


class EnvelopeReceiver(ChannelEnd):
    """Receives envelopes over one channel (rank 1) into destinations reserved with `expect`.

    `max_chunk_bytes` bounds the staging buffers a sender may ask for; `max_pages` bounds the
    envelope a header may describe; `unexpected_wait_s` is how long a transfer announced for a
    request that is not (yet) expected waits for `expect` before it is refused.
    """

    role = "receiver"

    def __init__(
        self,
        channel: Channel,
        *,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        max_pages: int = MAX_PAGES,
        unexpected_wait_s: float = UNEXPECTED_WAIT_S,
        idle_wait_s: float = IDLE_WAIT_S,
        activity: Activity | None = None,
    ) -> None:
        self.max_chunk_bytes, self.max_pages = max_chunk_bytes, max_pages
        self.unexpected_wait_s, self.idle_wait_s = unexpected_wait_s, idle_wait_s
        super().__init__(channel, RECEIVER_RANK, activity)
        # bell header: source table (16 bytes a row: the pages and the slot) + fields
        self._max_header_bytes = 16 * (max_pages + 1) + 4096
        self._expected: dict[str, Job] = {}
        # request id -> why its header is refused at once: the destination was refused or given up
        # here while its sender may be on its way (the header need not wait `unexpected_wait_s`).
        self._refused: collections.OrderedDict[str, HeaderRefused] = collections.OrderedDict()
        self.offers = OffersMade(channel, max_chunk_bytes)  # guarded by `cond`

    def expect(
        self,
        envelope: Envelope,
        buffer: torch.Tensor,
        *,
        deadline_s: float = EXPECT_WAIT_S,
        active_timeout_s: float | None = None,
        on_chunk: ChunkHook | None = None,
    ) -> Transfer:
        """Register a reserved destination (its bytes at `envelope.ranges` in `buffer`); its first
        `held_pages` pages are held here already: never received nor written.

        The transfer must begin within `deadline_s`; once it has, `active_timeout_s` (default: the
        rest of that deadline) bounds it. Its `first_token` is the header's. Raises ValueError for bad
        arguments or a request already expected; every other failure (nothing arrives by the
        deadline, a refused header, a broken link) concludes the transfer.
        """
        job = self.new_job(
            envelope,
            buffer,
            deadline_s=deadline_s,
            on_chunk=on_chunk,
            on_expire=self._expire,
            active_timeout_s=active_timeout_s,
        )
        with self.cond:
            if self.closed:
                raise ChannelError("the receiver is closed")
            if envelope.request_id in self._expected:
                raise AlreadyExpected(envelope.request_id)
            self._refused.pop(envelope.request_id, None)
            self._expected[envelope.request_id] = job
            self.offers.offer(job)  # under the lock: before any READY for it
            self.cond.notify_all()
        return job.transfer

    def connect(self, timeout_s: float | None = None) -> None:
        """(Re)connect the channel, then offer every reservation still waiting for its transfer: the
        sender's offers went with the former link, and one made while the channel was down never
        went out."""
        super().connect(timeout_s)
        with self.cond:
            for job in self._expected.values():
                self.offers.offer(job)

    def refuse(self, request_id: str, kind: FailureKind | None, reason: str = "") -> None:
        """Refuse the next header for `request_id` at once (as `kind`, with `reason`) unless it is
        expected by then; a header already waiting for it is refused now. A `kind` of None forgets
        an earlier refusal."""
        with self.cond:
            if kind is None:
                self._refused.pop(request_id, None)
                return
            self._refused[request_id] = HeaderRefused(kind, TURNED_AWAY, reason)
            self._refused.move_to_end(request_id)
            while len(self._refused) > MAX_REFUSALS_KEPT:  # never read ones go, oldest first
                self._refused.popitem(last=False)
            self.cond.notify_all()

    def drop_pending(self) -> list[Job]:
        jobs, self._expected = list(self._expected.values()), {}
        return jobs

    # ---- registry --------------------------------------------------------------------------------
    def _expire(self, transfer: Transfer) -> None:
        with self.cond:
            job = self._expected.get(transfer.request_id)
            if job is None or job.transfer is not transfer:
                return  # already taken by the worker, which concludes it
            del self._expected[transfer.request_id]
            self.offers.retract(job)
        transfer.conclude(transfer.unstarted_error("no transfer arrived from the sender before the deadline"))

    def _take(self, request_id: str, *, wait: bool = True) -> tuple[Job | None, HeaderRefused | None]:
        """The expectation a header names (waiting up to `unexpected_wait_s` for it, if `wait`), or
        why not."""
        limit = time.monotonic() + (self.unexpected_wait_s if wait else 0.0)
        with self.io_lock.waiting(), self.cond:  # for the reservation, perhaps: nothing moves
            while (
                request_id not in self._expected
                and request_id not in self._refused
                and not self.closed
                and time.monotonic() < limit
            ):
                self.cond.wait(limit - time.monotonic())
            job = self._expected.pop(request_id, None)
            refused = self._refused.pop(request_id, None)  # read once: a later attempt may be expected
        if job is None:
            return None, refused or HeaderRefused(
                FailureKind.REFUSED, NOT_EXPECTED, "no reservation for this request on the receiver"
            )
        return job, None

    # ---- worker ----------------------------------------------------------------------------------
    def run(self) -> None:
        while not self.closed:
            if not self.channel.healthy:
                with self.cond:
                    self.cond.wait(0.05)
                continue
            try:
                bell = self.channel.wait_bell(self.idle_wait_s)
            except ChannelError:
                continue  # marked broken (or reconnecting); wait for the next generation
            if bell is None or self.closed:
                continue
            with self.io_lock:
                self._receive_one(*bell)

    def _receive_one(self, seq: int, blob: bytes) -> None:
        header, job, refusal, offered = None, None, None, None
        try:
            header = decode_message(blob, expect=(HEADER,), max_bytes=self._max_header_bytes)
            # Planned on an offer: its payload is on its way, so nothing waits for an expectation.
            job, refusal = self._take(header["request_id"], wait=not header["offer"])
            with self.cond:
                offered = self.offers.offered(job, header["offer"])
            if job is not None and header["offer"] not in (0, job.offer):
                detail = f"planned on offer {header['offer']}, which offer {job.offer} replaced"
                refusal = HeaderRefused(FailureKind.REFUSED, OFFER_STALE, detail)
            elif job is not None:
                refusal = check_header(job, seq, header, self.channel.tp_pair, self.max_chunk_bytes)
        except ProtocolError as exc:
            refusal = HeaderRefused(FailureKind.PROTOCOL, MALFORMED_HEADER, f"malformed header: {exc}")
        rid = header["request_id"] if header is not None else "?"

        def receive() -> None:
            if header is not None and header["offer"]:
                return self._receive_offered(seq, header, job, refusal, offered)
            answer = refusal
            if answer is None and self.channel.control.holds(withdraw_key(seq)):
                reason = "the sender withdrew the transfer (its deadline passed)"
                answer = HeaderRefused(FailureKind.TIMEOUT, SENDER_WITHDREW, reason)
            reply = (
                encode_message(
                    REFUSE, seq=seq, failure=answer.kind, problem=answer.problem, reason=answer.detail
                )
                if answer is not None
                else encode_message(
                    READY, seq=seq, table=table_bytes(job.envelope.moving), held=job.envelope.held_pages
                )
            )
            self.channel.control.send(reply_key(seq), reply)
            if answer is not None:
                raise Stopped(answer.kind, f"refused the sender's header: {answer.detail}", cause=answer)
            if job is None or header is None:
                raise RuntimeError("a header accepted without its job")
            self._receive_accepted(seq, header, job)

        def tell_sender(error: TransferError) -> None:
            if job is not None and job.transfer.began_at is not None:
                # The sender fails now, and knows why, rather than at its deadline.
                broken = encode_message(
                    STATUS,
                    seq=seq,
                    ok=False,
                    failure=error.kind,
                    reason=error.reason,
                    broken=True,
                    problem="",
                )
                try:
                    self.channel.control.send(status_key(seq), broken, wait_s=TELL_PEER_S)
                except ChannelError:  # the link is what failed: the sender hears it closing instead
                    pass

        # A withdrawal that comes after the answer is never read: tidied with the transfer.
        self.conclude(rid, job, receive, unread=[withdraw_key(seq)], on_broken=tell_sender)

    def _receive_accepted(self, seq: int, header: dict, job: Job) -> None:
        """Receive an accepted transfer's payload into its destination, then say how it went."""
        job.transfer.first_token = header["first_token"]
        job.transfer.begin()
        failure = receive_payload(self, job, seq, header)
        if failure is not None:
            self._status(seq, failure)
            raise Stopped(*failure)
        self.stream.synchronize()  # the bytes are in place before anyone hears "success"
        self._status(seq)

    def _receive_offered(
        self, seq: int, header: dict, job: Job | None, refusal: HeaderRefused | None, offered: Envelope | None
    ) -> None:
        """A header planned on our offer: its payload follows it, unanswered. Receive it into the
        job's destination, or, refused, discard it (planned on the offer) and say why in STATUS.
        A payload this end cannot plan costs the channel: it cannot stay in step."""
        if refusal is None and job is not None:
            self._receive_accepted(seq, header, job)
            return
        why = f"a payload planned on offer {header['offer']} cannot be discarded"
        if refusal is None or offered is None or refusal.problem == MALFORMED_HEADER:
            raise ProtocolError(f"{why}: {refusal.detail if refusal else 'no refusal'}")
        if (limits := out_of_limits(header, self.max_chunk_bytes)) is not None:
            raise ProtocolError(f"{why}: {limits}")
        try:
            runs = header_runs(self.channel.tp_pair, offered, header)
        except (ProtocolError, ValueError) as exc:
            raise ProtocolError(f"{why}: the header's table does not pair with the offer's: {exc}") from None
        discard_payload(self, runs, seq, header, time.monotonic() + self.channel.timeout_s)
        self._status(seq, (refusal.kind, refusal.detail), problem=refusal.problem)
        raise Stopped(refusal.kind, f"refused the sender's header: {refusal.detail}", cause=refusal)

    def _status(self, seq: int, failure: tuple[FailureKind, str] | None = None, *, problem: str = "") -> None:
        """STATUS ok (no `failure`), or failed as `failure`: (kind, reason); `problem`: a refusal's
        (of a header planned on an offer)."""
        kind, reason = failure or ("", "")
        message = encode_message(
            STATUS, seq=seq, ok=failure is None, failure=kind, reason=reason, broken=False, problem=problem
        )
        self.channel.control.send(status_key(seq), message)
