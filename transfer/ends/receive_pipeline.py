"""The receiving side of one transfer's payload: chunk k is scattered while chunks k+1 and k+2 arrive.

    `receive_payload`: the chunks, the trailer, the sender's ABORT after an unfilled stream, and
        the checksum
    `discard_payload`: the payload of a refused transfer planned on an offer, received chunk by
        chunk into staging and dropped, then its trailer (and ABORT)
    `ReceivePipeline`: keep three chunks' receives posted (messages contiguous here straight into
        our arena, staged ones into staging buffer k % 3); land chunk k (its staged messages are
        scattered as they come, while the chunk's other messages and chunks k+1 and k+2 arrive),
        then post k+3

Where bytes go is computed from this end's own ranges alone (`Job.runs`); the sending side is
`transfer.ends.send_pipeline`, and the control messages around both are the ends' own.
"""

from __future__ import annotations

import collections
import time

import numpy as np
import torch

from transfer.ends.end import ChannelEnd, Job
from transfer.ends.staging import PIPELINE_DEPTH, StagingBuffers, checksum, scatter
from transfer.pair import Channel
from transfer.plans import DST, NBYTES, Chunk, MessagePlan
from transfer.wire import (
    ABORT,
    TAG_DATA,
    TRAILER_WORDS,
    ChannelError,
    FailureKind,
    abort_key,
    read_trailer,
)


def receive_payload(end: ChannelEnd, job: Job, seq: int, header: dict) -> tuple[FailureKind, str] | None:
    """Receive transfer `seq`'s payload at the receiving `end` (its `header` accepted, `job.runs`
    planned) into the job's arena and read its trailer: None when it landed whole (and matches its
    checksum, if one was asked), else how it failed, (kind, reason): our own abort, the sender's
    (its ABORT says why), or a checksum mismatch. A sender that never says why it aborted costs the
    channel (ChannelError)."""
    deadline, runs = job.transfer.deadline, job.runs
    pipeline = ReceivePipeline(end.channel, end.staging, job, _plan(runs, header, end.channel.num_streams))
    aborted = pipeline.receive(deadline)
    filled, sent_checksum = pipeline.receive_trailer(seq, deadline)
    failure = None if aborted is None else (FailureKind.ABORTED, aborted)
    if not filled:  # the sender aborted: its ABORT says why
        failure = failure or _sender_abort(end, seq, deadline)
    elif failure is None and header["checksum"]:
        ours = checksum(job.buffer, runs[:, DST], runs[:, NBYTES])
        if sent_checksum != ours:
            failure = (FailureKind.CORRUPT, f"checksum mismatch: sender {sent_checksum}, receiver {ours}")
    return failure


def _plan(runs: np.ndarray, header: dict, num_streams: int) -> MessagePlan:
    """The messages of a payload planned on `runs` with the `header`'s sizes, as the sender plans
    them: chunk by chunk, so that chunk 0's receives are posted before the rest is planned."""
    return MessagePlan(
        runs,
        chunk_bytes=header["chunk_bytes"],
        direct_min_bytes=header["direct_min_bytes"],
        num_streams=num_streams,
    )


def _sender_abort(end: ChannelEnd, seq: int, deadline: float) -> tuple[FailureKind, str]:
    """Why the sender aborted transfer `seq` (its ABORT, which follows an unfilled trailer)."""
    abort = end.await_message(
        abort_key(seq), seq, expect=(ABORT,), timeout_s=deadline - time.monotonic(), max_bytes=4096
    )
    if abort is None:
        reason = "the sender did not say why it aborted the transfer before the deadline"
        raise ChannelError(reason, kind=FailureKind.TIMEOUT)
    return FailureKind(abort["failure"]), f"sender aborted: {abort['reason']}"


def discard_payload(end: ChannelEnd, runs: np.ndarray, seq: int, header: dict, deadline: float) -> None:
    """Receive transfer `seq`'s payload, planned on `runs` with the `header`'s sizes, chunk by chunk
    into a staging buffer, and drop it; then its trailer (and the sender's ABORT, if it aborted).
    Nothing is written to any arena: the destination it was planned on may be another's by now."""
    channel = end.channel
    chunks = _plan(runs, header, channel.num_streams)
    for chunk in chunks:
        scratch, works, at, streams = end.staging.get(0, chunk.nbytes), [], 0, chunks.streams(chunk.index)
        for message, stream in zip(chunk.messages, streams, strict=True):
            works.append(channel.recv(scratch[at : at + message.nbytes], TAG_DATA + stream))
            at += message.nbytes
        for work in works:
            channel.wait(work, deadline, f"discarding chunk {chunk.index}")
    received = torch.zeros(TRAILER_WORDS, dtype=torch.int64, device=end.staging.device)
    channel.wait(channel.recv(received, TAG_DATA), deadline, "receiving the trailer")
    filled, _ = read_trailer(received, seq)
    if not filled:
        _sender_abort(end, seq, deadline)


class ReceivePipeline:
    """Receives one transfer's chunks (a `MessagePlan` of its runs, as the sender plans them) into
    the job's arena: `receive` posts and lands them all, in plan order."""

    def __init__(self, channel: Channel, staging: StagingBuffers, job: Job, chunks: MessagePlan) -> None:
        self.channel, self.staging, self.job, self.chunks = channel, staging, job, chunks
        self._trailer: tuple[object, torch.Tensor] | None = None  # (work, tensor) once posted

    def receive(self, deadline: float) -> str | None:
        """Post and land every chunk (and post the trailer's receive); returns the reason of our own
        abort, if the transfer was aborted meanwhile (the stream still drains then, but nothing more
        is scattered)."""
        job, chunks = self.job, self.chunks
        transfer = job.transfer
        # Receives are posted in plan order (NCCL matches them in order), as far ahead as buffers
        # allow: chunk j's staged messages take staging buffer j % DEPTH, free once chunk j-DEPTH
        # landed; messages contiguous here land in the arena in place and need none. So chunks
        # k+1 and k+2 (at least) are arriving while chunk k is scattered.
        posted: collections.deque[tuple[Chunk, list, list]] = collections.deque()
        num_posted = num_landed = 0

        def post_ahead() -> None:
            nonlocal num_posted
            while num_posted < len(chunks) and (
                num_posted - PIPELINE_DEPTH < num_landed
                or all(m.in_place_at(DST) is not None for m in chunks[num_posted].messages)
            ):
                posted.append(self._post(chunks[num_posted], chunks.streams(num_posted)))
                num_posted += 1
            if num_posted == len(chunks) and self._trailer is None:
                # Posted with the last chunk, so that it lands with the stream: a Gloo message
                # waits for its receive to be posted, which costs a round trip of the I/O threads.
                received = torch.zeros(TRAILER_WORDS, dtype=torch.int64, device=job.buffer.device)
                self._trailer = (self.channel.recv(received, TAG_DATA), received)

        aborted: str | None = None  # our own abort: the stream still drains, nothing more is scattered
        post_ahead()
        for _ in range(len(chunks)):
            self._land(posted.popleft(), deadline, scatter_staged=aborted is None)
            num_landed += 1
            post_ahead()
            aborted = aborted or transfer.abort_reason
        return aborted

    def receive_trailer(self, seq: int, deadline: float) -> tuple[bool, int | None]:
        """The stream's last message, after every chunk: (filled, checksum or None) of transfer
        `seq`; ProtocolError when it is not that transfer's trailer."""
        if self._trailer is None:
            raise RuntimeError("receive() posts the trailer's receive first")
        work, received = self._trailer
        self.channel.wait(work, deadline, "receiving the trailer")
        return read_trailer(received, seq)

    def _post(self, chunk: Chunk, streams: list[int]) -> tuple[Chunk, list, list]:
        """Post the receives of one chunk (message i on stream `streams[i]`): direct messages
        straight into the arena."""
        works, buffers = [], []
        channel = self.channel
        staged = self.staging.get(chunk.index, chunk.staged_bytes(DST))
        for message, stream, at in zip(chunk.messages, streams, chunk.staging_offsets(DST), strict=True):
            offset = message.in_place_at(DST)
            if offset is not None:
                buffer = self.job.buffer[offset : offset + message.nbytes]
            else:
                buffer = staged[at : at + message.nbytes]
            works.append(channel.recv(buffer, TAG_DATA + stream))
            buffers.append(buffer)
        return chunk, works, buffers

    def _land(self, posted: tuple[Chunk, list, list], deadline: float, *, scatter_staged: bool) -> None:
        """Wait for a posted chunk's messages and scatter its staged one into the arena as soon as
        it is in (the plan sends it first: its scatter overlaps the chunk's zero-copy messages)."""
        job = self.job
        chunk, works, buffers = posted
        for message, work, buffer in zip(chunk.messages, works, buffers, strict=True):
            self.channel.wait(work, deadline, f"receiving chunk {chunk.index}")
            if scatter_staged and message.in_place_at(DST) is None:
                scatter(buffer, message.pieces[:, DST], message.pieces[:, NBYTES], job.buffer)
        if not scatter_staged:
            return
        job.transfer.num_chunks_done = chunk.index + 1
        if job.transfer.on_chunk is not None:
            job.transfer.on_chunk(job.transfer, chunk.index)
