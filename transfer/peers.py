"""A worker's channels, one per peer: what prefill and decode workers call to move envelopes.

Prefill workers hold the sending end (rank 0, which also holds the rendezvous port) of a channel
to every decode worker; decode workers hold the receiving end of one channel per prefill worker.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from distpool.memory.envelope import Envelope
from distpool.memory.sizing import TpEnd
from transfer.defaults import EXPECT_WAIT_S
from transfer.ends import Activity, EnvelopeReceiver, EnvelopeSender, Transfer, TransferOptions, measure
from transfer.faults import FaultInjector
from transfer.pair import RECEIVER_RANK, SENDER_RANK, Channel
from transfer.wire import ChannelError, FailureKind


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
        secret: bytes,
        tp: TpEnd | None = None,
    ) -> None:
        self.own_name = own_name
        self.tp = tp  # this rank's TP layout, which its channels present in the handshake
        self.rank = rank
        self.fingerprint = fingerprint
        self.layout = layout
        self.device = device
        self.options = options
        self._secret = secret  # the deployment's: names and seals every control message
        self._ends: dict[str, EnvelopeSender | EnvelopeReceiver] = {}
        self._lives: dict[str, int] = {}  # peer -> the life (restart count) its channel was opened for
        self._lock = threading.Lock()
        self.activity = Activity()  # whether any end moves bytes now (model work waits on it)
        self.faults = FaultInjector()  # faults planned on purpose (tests, --fault-rate); none in production

    def open(self, peer: str, *, host: str, port: int, peer_life: int = 0) -> None:
        """Connect to `peer` (which must open its end concurrently); an existing channel is rebuilt.
        `peer_life` counts the peer's restarts: a `drop` for an earlier life leaves this channel alone."""
        with self._lock:
            end = self._ends.get(peer)
            self._lives[peer] = max(self._lives.get(peer, 0), peer_life)
        if end is not None and (end.channel.host, end.channel.port) == (host, port):
            end.connect()
            return
        if end is not None:  # the peer's port moved (it restarted): a new channel, not a new generation
            self.drop(peer)
        names = (self.own_name, peer) if self.rank == SENDER_RANK else (peer, self.own_name)
        channel = Channel(
            rank=self.rank,
            host=host,
            port=port,
            device=self.device,
            fingerprint=self.fingerprint,
            layout=self.layout,
            timeout_s=self.options.timeout_s,
            secret=self._secret,
            name=channel_name(*names),
            tp=self.tp,
        )
        if self.rank == SENDER_RANK:
            end: EnvelopeSender | EnvelopeReceiver = EnvelopeSender(
                channel, self.options, activity=self.activity
            )
        else:  # its senders use this deployment's chunk size: the receiver accepts exactly that much
            end = EnvelopeReceiver(channel, max_chunk_bytes=self.options.chunk_bytes, activity=self.activity)
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
            if peer not in self._ends:  # never opened, or dropped when the peer died
                raise ChannelError(f"{self.own_name} has no channel to {peer!r}")
            return self._ends[peer]

    def broken(self, peer: str) -> bool:
        """Whether the channel to `peer` needs rebuilding: broken, or missing (never opened in this
        life, say after Ray restarted this rank behind the driver's back, or dropped). Raising for a
        missing one left such a pair unrebuilt for the rest of a run, every transfer on it failing."""
        with self._lock:
            end = self._ends.get(peer)
        return end is None or not end.channel.healthy

    def submit(self, peer: str, envelope: Envelope, buffer: torch.Tensor, *, first_token: int) -> Transfer:
        """Queue one envelope for `peer`; the returned transfer concludes within the timeout."""
        end = self._end(peer)
        if not isinstance(end, EnvelopeSender):
            raise TypeError("only the rank-0 end sends")
        hook = self.faults.sender_hook(envelope.request_id, self.options.timeout_s)
        return end.submit(envelope, buffer, first_token=first_token, on_chunk=hook)

    def expect(
        self,
        peer: str,
        envelope: Envelope,
        buffer: torch.Tensor,
        *,
        wait_s: float = EXPECT_WAIT_S,
    ) -> Transfer:
        """Expect `envelope` from `peer` within `wait_s`; once it begins, the timeout bounds it."""
        end = self._end(peer)
        if not isinstance(end, EnvelopeReceiver):
            raise TypeError("only the rank-1 end receives")
        hook = self.faults.receiver_hook(envelope.request_id, buffer, envelope.moving)
        timeout_s = self.options.timeout_s
        return end.expect(envelope, buffer, deadline_s=wait_s, active_timeout_s=timeout_s, on_chunk=hook)

    def refuse(
        self, request_id: str, kind: FailureKind | None, reason: str = "", peer: str | None = None
    ) -> None:
        """Refuse the next header for `request_id` from `peer` (None: from any peer) at once, as
        `kind` with `reason`; a `kind` of None forgets such a refusal. See `EnvelopeReceiver.refuse`."""
        with self._lock:
            ends = [self._ends[peer]] if peer in self._ends else [] if peer else list(self._ends.values())
        for end in ends:
            if not isinstance(end, EnvelopeReceiver):
                raise TypeError("only the rank-1 end receives")
            end.refuse(request_id, kind, reason)

    def measure_link(self, peer: str, nbytes: int, repeats: int) -> float | None:
        """Time `repeats` raw messages of `nbytes` to or from `peer` (who must call this at the same
        time); the receiving end returns the median seconds per message, the sending end None."""
        return measure(self._end(peer), nbytes, repeats, self.options.chunk_bytes)

    def moving(self) -> bool:
        """Whether a transfer (or a link measurement) is moving bytes on any channel right now."""
        return self.activity.busy()

    def rejected_messages(self) -> int:
        """Control messages that did not open under the deployment's secret, over every channel."""
        with self._lock:
            ends = list(self._ends.values())
        return sum(end.channel.rejected_messages for end in ends)

    def address_of(self, peer: str) -> tuple[str, int] | None:
        with self._lock:
            end = self._ends.get(peer)
        return None if end is None else (end.channel.host, end.channel.port)

    def drop(self, peer: str, peer_life: int | None = None) -> None:
        """Close the channel to `peer` (if any): its pending transfers fail, the next `open` starts anew.
        With `peer_life`, only a channel opened for that life (or an earlier one) is closed."""
        with self._lock:
            if peer_life is not None and self._lives.get(peer, 0) > peer_life:
                return  # the peer came back already, and this channel is to its new life
            end = self._ends.pop(peer, None)
        if end is not None:
            end.close(FailureKind.PEER_LOST)  # its transfers fail as the peer's loss

    def close_all(self) -> None:
        with self._lock:
            ends, self._ends = list(self._ends.values()), {}
        for end in ends:
            end.close()


__all__ = ["RECEIVER_RANK", "SENDER_RANK", "PeerChannels", "channel_name"]
