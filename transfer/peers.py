"""A worker's channels, one per peer: what prefill and decode workers call to move envelopes.

Prefill workers hold the sending end (rank 0, which also hosts the rendezvous store) of a channel
to every decode worker; decode workers hold the receiving end of one channel per prefill worker.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from distpool.memory.envelope import Envelope
from transfer.channel import RECEIVER_RANK, SENDER_RANK, Channel
from transfer.handle import Transfer, TransferOptions
from transfer.receiver import EnvelopeReceiver
from transfer.sender import EnvelopeSender

INJECTED_FAULT = "injected fault (--fault-rate)"


def channel_name(prefill_name: str, decode_name: str) -> str:
    return f"{prefill_name}->{decode_name}"


class PeerChannels:
    def __init__(
        self,
        *,
        own_name: str,
        rank: int,
        fingerprint: str,
        layout: dict[str, Any],
        device: torch.device,
        options: TransferOptions,
    ) -> None:
        self.own_name = own_name
        self.rank = rank
        self.fingerprint = fingerprint
        self.layout = layout
        self.device = device
        self.options = options
        self._ends: dict[str, EnvelopeSender | EnvelopeReceiver] = {}
        self._lock = threading.Lock()

    def open(self, peer: str, *, host: str, port: int) -> None:
        """Connect to `peer` (which must open its end concurrently); an existing channel is rebuilt."""
        with self._lock:
            end = self._ends.get(peer)
        if end is not None:
            end.connect()
            return
        names = (self.own_name, peer) if self.rank == SENDER_RANK else (peer, self.own_name)
        channel = Channel(
            rank=self.rank,
            host=host,
            port=port,
            device=self.device,
            fingerprint=self.fingerprint,
            layout=self.layout,
            timeout_s=self.options.timeout_s,
            name=channel_name(*names),
        )
        end = EnvelopeSender(channel, self.options) if self.rank == SENDER_RANK else EnvelopeReceiver(channel)
        try:
            end.connect()
            end.start()
        except BaseException:
            end.close()
            raise
        with self._lock:
            self._ends[peer] = end

    def _end(self, peer: str) -> EnvelopeSender | EnvelopeReceiver:
        with self._lock:
            if peer not in self._ends:
                raise ValueError(f"{self.own_name} has no channel to {peer!r}")
            return self._ends[peer]

    def broken(self, peer: str) -> bool:
        return not self._end(peer).channel.healthy

    def submit(
        self,
        peer: str,
        envelope: Envelope,
        buffer: torch.Tensor,
        ranges: torch.Tensor,
        *,
        first_token: int,
        fault_after_chunks: int | None = None,
    ) -> Transfer:
        """Queue one envelope for `peer`; the returned transfer concludes within the timeout."""
        end = self._end(peer)
        assert isinstance(end, EnvelopeSender), "only the rank-0 end sends"
        hook = None
        if fault_after_chunks is not None:

            def hook(transfer: Transfer, chunk: int) -> None:
                if chunk >= fault_after_chunks:
                    transfer.abort(INJECTED_FAULT)

        return end.submit(envelope, buffer, ranges, first_token=first_token, on_chunk=hook)

    def expect(
        self, peer: str, envelope: Envelope, buffer: torch.Tensor, ranges: torch.Tensor, *, wait_s: float
    ) -> Transfer:
        """Expect `envelope` from `peer` within `wait_s`; once it begins, the timeout bounds it."""
        end = self._end(peer)
        assert isinstance(end, EnvelopeReceiver), "only the rank-1 end receives"
        return end.expect(
            envelope, buffer, ranges, deadline_s=wait_s, active_timeout_s=self.options.timeout_s
        )

    def close_all(self) -> None:
        with self._lock:
            ends, self._ends = list(self._ends.values()), {}
        for end in ends:
            end.close()


__all__ = ["RECEIVER_RANK", "SENDER_RANK", "PeerChannels", "channel_name"]
