"""A receiver's offers: each reserved destination told to the sender before its header comes.

`expect` offers a destination (OFFER: its table, held pages, tokens, rows and the chunk limit) so
that a sender holding it can send its payload right behind the header; a reservation that ends
before its transfer came is taken back (RETRACTED). A header names the offer it was planned on,
and `offered` finds the destination behind it, even one whose reservation is gone: its payload is
discarded by the plan made on it. Offers are optional messages (`ControlPlane.send`): not posted
while the sender is slow to take control messages, and a reservation then goes without one.
"""

from __future__ import annotations

import collections

from distpool.memory.envelope import Envelope
from transfer.ends.end import Job
from transfer.pair import Channel
from transfer.wire import (
    MAX_OFFERS_MADE,
    OFFER,
    RETRACTED,
    ChannelError,
    ProtocolError,
    encode_message,
    offer_key,
    table_bytes,
)


class OffersMade:
    """The offers one receiver made: serial -> the destination offered, the newest
    `MAX_OFFERS_MADE`. Not locked: the receiver calls it under its condition lock, so that an OFFER
    goes out before any READY for its request."""

    def __init__(self, channel: Channel, max_chunk_bytes: int) -> None:
        self.channel, self.max_chunk_bytes = channel, max_chunk_bytes
        self._made: collections.OrderedDict[int, Envelope] = collections.OrderedDict()
        self._last = 0

    def __len__(self) -> int:
        return len(self._made)

    def offer(self, job: Job) -> None:
        """Offer `job`'s destination (its `offer` is set to the serial). Not connected, or the sender
        slow to take control messages: no offer, and the header waits for READY."""
        envelope, serial = job.envelope, self._last + 1
        message = encode_message(
            OFFER,
            request_id=envelope.request_id,
            serial=serial,
            num_tokens=envelope.num_tokens,
            num_rows=envelope.ranges.shape[0],
            table=table_bytes(envelope.moving),
            held=envelope.held_pages,
            max_chunk_bytes=self.max_chunk_bytes,
        )
        try:
            if not self.channel.control.send(offer_key(envelope.request_id), message, optional=True):
                return
        except ChannelError:
            return
        self._last = job.offer = serial
        self._made[serial] = envelope
        while len(self._made) > MAX_OFFERS_MADE:
            self._made.popitem(last=False)

    def retract(self, job: Job) -> None:
        """Take back `job`'s offer (its reservation ended unstarted). Not posted while the sender is
        slow: it may plan on the offer, and is refused then (its payload discarded)."""
        if not job.offer:
            return
        message = encode_message(RETRACTED, request_id=job.envelope.request_id, serial=job.offer)
        try:
            self.channel.control.send(offer_key(job.envelope.request_id), message, optional=True)
        except ChannelError:
            pass

    def offered(self, job: Job | None, serial: int) -> Envelope | None:
        """The destination offered under `serial` (0: none) to a header that took `job` (None: no
        reservation); its record goes. Other records stay until newer ones push them out: a sender
        may still hold such an offer (say, one that came after it had sent its header), and a
        payload planned on it is then discarded by that record, not by the channel. ProtocolError
        for a serial this end never made, or no longer remembers."""
        if not serial:
            return None
        envelope = self._made.pop(serial, None)
        if job is not None and job.offer == serial:
            return job.envelope
        if envelope is None:
            raise ProtocolError(f"a header planned on offer {serial}, which this receiver did not make")
        return envelope
