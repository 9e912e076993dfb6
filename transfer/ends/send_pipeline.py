"""The sending side of one transfer's chunks: chunk k+1 is gathered while chunk k is on the wire.

    for each chunk k: start gathering chunk k+1 (staging buffer (k+1) % 3, once the sends of the
        chunk that used it are done), then send chunk k's messages; big runs, and batches that
        are contiguous here, go straight from the arena. After an abort the rest of the stream
        goes unfilled (no gathers): both ends stay in step without a control message in the group.
    then the trailer (`transfer.wire.protocol.trailer`): filled or not, and the checksum

The gather of chunk k+1 overlaps the send of chunk k: on CPU a gather thread (a Gloo send may
write synchronously in the calling thread), on CUDA the copy stream beside NCCL's. The receiving
side is `transfer.ends.receive_pipeline`; the control messages around both are the ends' own.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from transfer.ends.end import Job
from transfer.ends.staging import PIPELINE_DEPTH, StagingBuffers, gather
from transfer.pair import Channel
from transfer.plans import NBYTES, SRC, Chunk, Message, MessagePlan
from transfer.wire import TAG_DATA


def staged_messages(chunk: Chunk) -> list[Message]:
    """The chunk's messages the sender gathers (back to back in its staging buffer, in plan order)."""
    return [m for m in chunk.messages if m.in_place_at(SRC) is None]


class SendPipeline:
    """Sends one transfer's chunks (a `MessagePlan` of its runs) in plan order: `send` posts every
    chunk's sends, gathering ahead; `drain` waits for the sends still in flight.

    `gatherer` is the sender's gather thread (CPU), or None: gathers are enqueued on the copy
    stream in the calling thread (CUDA).
    """

    def __init__(
        self,
        channel: Channel,
        staging: StagingBuffers,
        gatherer: ThreadPoolExecutor | None,
        job: Job,
        chunks: MessagePlan,
    ) -> None:
        self.channel, self.staging, self.gatherer = channel, staging, gatherer
        self.job, self.chunks = job, chunks
        # (chunk index, works, tensors that must outlive the works)
        self.in_flight: collections.deque[tuple[int, list, list]] = collections.deque()
        self._trailer: tuple[object, torch.Tensor] | None = None  # (work, tensor) once posted

    def send(self, deadline: float) -> None:
        """Post every chunk's sends, the transfer's progress counted as they go (until it aborts)."""
        channel, job, chunks, in_flight = self.channel, self.job, self.chunks, self.in_flight
        transfer = job.transfer
        # chunk index -> gather (a pair that moves nothing of this envelope sends no chunk at all)
        gathered: dict[int, Future | None] = {0: self._stage(chunks[0])} if chunks else {}
        for chunk in chunks:
            ahead = chunk.index + 1
            if ahead < len(chunks) and staged_messages(chunks[ahead]):
                # Chunk k+1 is gathered into the buffer chunk k+1-DEPTH used: its sends must be done.
                # Chunks without a staged message need no buffer, so nothing limits their sends.
                while in_flight and in_flight[0][0] <= ahead - PIPELINE_DEPTH:
                    index, works, _ = in_flight.popleft()
                    for work in works:
                        channel.wait(work, deadline, f"sending chunk {index}")
                gathered[ahead] = self._stage(chunks[ahead])
            if (future := gathered.pop(chunk.index, None)) is not None:
                future.result(timeout=max(deadline - time.monotonic(), 0.0))  # deadlines everywhere
            works, keep = [], []
            staged = self.staging.get(chunk.index, chunk.staged_bytes(SRC))
            for message, stream, at in zip(
                chunk.messages, chunks.streams(chunk.index), chunk.staging_offsets(SRC), strict=True
            ):
                offset = message.in_place_at(SRC)
                if offset is not None:
                    payload = job.buffer[offset : offset + message.nbytes]
                else:
                    payload = staged[at : at + message.nbytes]
                # A send may write synchronously (Gloo, peer ready): the next gather runs meanwhile.
                works.append(channel.send(payload, TAG_DATA + stream))
                keep.append(payload)
            in_flight.append((chunk.index, works, keep))
            if transfer.abort_reason is None:
                transfer.num_chunks_done = chunk.index + 1
                if transfer.on_chunk is not None:
                    transfer.on_chunk(transfer, chunk.index)

    def first_send(self) -> object | None:
        """The stream's first send, if no wait took it yet (a full pipeline may have), handed to the
        caller to wait for: a Gloo send's wait takes its completion, so `drain` no longer waits
        for it. Until the receiver takes it, nothing of the stream moves."""
        if self.in_flight and self.in_flight[0][0] == 0 and self.in_flight[0][1]:
            return self.in_flight[0][1].pop(0)
        return None

    def post_trailer(self, trailer: torch.Tensor) -> None:
        """Post the stream's last message, the trailer (`transfer.wire.protocol.trailer`), on stream 0.
        `drain` leaves it alone: its send completes once the receiver reads it, which a receiver that
        failed after the last chunk never does (a Gloo send to a closed link waits out its deadline)."""
        self._trailer = (self.channel.send(trailer, TAG_DATA), trailer)

    def drain_trailer(self, deadline: float) -> None:
        """Wait for the trailer's send: at once after the receiver's STATUS, which it sends once it
        read the trailer."""
        if self._trailer is not None:
            self.channel.wait(self._trailer[0], deadline, "sending the trailer")
            self._trailer = None

    def drain(self, deadline: float) -> None:
        """Wait for every send still in flight."""
        for index, works, _ in self.in_flight:
            for work in works:
                self.channel.wait(work, deadline, f"sending chunk {index}")

    def _stage(self, chunk: Chunk) -> Future | None:
        """Start gathering the chunk's staged messages into its buffer (None: nothing to gather).

        On CPU the gather runs on the gather thread; on CUDA it is enqueued on the copy stream
        right here (the GPU overlaps it with NCCL's sends). After an abort, nothing is gathered:
        the rest of the stream goes unfilled, which keeps both ends in step.
        """
        job = self.job
        messages = staged_messages(chunk)
        if not messages or job.transfer.abort_reason is not None:
            return None
        staged = self.staging.get(chunk.index, chunk.staged_bytes(SRC))
        # One gather for them all: back to back in the buffer, their pieces are in stream order.
        pieces = messages[0].pieces if len(messages) == 1 else np.concatenate([m.pieces for m in messages])
        args = (job.buffer, pieces[:, SRC], pieces[:, NBYTES], staged)
        if self.gatherer is None:
            gather(*args)
            return None
        return self.gatherer.submit(gather, *args)
