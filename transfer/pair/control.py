"""The control plane of one channel generation: small sealed messages over the pair's own link.

Headers, replies, withdrawals, ends and statuses (names in `transfer.wire.protocol`) travel over a Gloo
group of the pair itself, with `TAG_CONTROL`: the payload group on CPU, a small Gloo group beside
NCCL's on CUDA. Nothing else can write there once the group formed, and the rendezvous store is
gone by then (`transfer.connect.rendezvous`). A message is one Gloo message, a *frame* of at most
`FRAME_BYTES` (the reader keeps a receive of that size posted, so a frame lands at once):

    u32 body length | body = u16 name length, name, value, MAC

A body longer than the frame (a header of thousands of pages) sends its first `FRAME_BYTES - 4`
bytes in the frame and the rest as a second Gloo message of exactly that size.

The MAC (`transfer.connect.auth`) covers the value and its full name: channel, generation, the sender's
rank, kind and sequence. A body that does not open is counted in `rejected` and dropped.

A Gloo send completes only once the peer posted its receive, so `send` does not wait: it posts, and
a delivery thread waits for the sends in order (a peer that is stopped holds them, not the caller).
A reader thread keeps a receive posted and files each message in a mailbox by name (a receiver's
offers apart, in an `OfferStore`: `take_offer`); `wait_value` waits on the mailbox, so a wait that
times out costs nothing (a Gloo wait that times out would close the group). Both hold at most
`MAX_PENDING` messages: the mailbox drops its oldest, and a peer that takes none of `MAX_PENDING`
sends breaks the channel. Both threads end when the link closes: the peer went (the channel is then
broken, `on_gone`) or this end closed the group (`transfer.pair.channel.close_links`, after `close`).
"""

from __future__ import annotations

import collections
import struct
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from distpool.memory.envelope import MAX_PAGES
from transfer.connect import MAC_BYTES, ControlAuth, delta
from transfer.wire import MAX_OFFER_BYTES_KEPT, MAX_OFFERS_KEPT, OFFER_PREFIX, TAG_CONTROL, ChannelError

MAX_PENDING = 64  # messages filed and not read, or sent and not taken; in step, a handful at most
# Offers are posted only while fewer sends than this wait for the peer (`send(..., optional=True)`):
# a burst of reservations must not fill the outbox that breaks the channel when full.
MAX_OPTIONAL_PENDING = MAX_PENDING // 2
# The largest body: a header or READY with a table of MAX_PAGES pages and a slot (16 bytes a row),
# its fields, name and MAC.
MAX_MESSAGE_BYTES = 16 * (MAX_PAGES + 1) + 8192
FOREVER_S = 365 * 86400.0  # the threads' waits: ended by the link closing, never by a timeout
_NAME_LEN = struct.Struct("<H")
_BODY_LEN = struct.Struct("<I")
# One frame covers every message but headers and replies of more than ~4,000 pages: one Gloo message
# each way, where a length then a body took two receives and a thread wake-up each.
FRAME_BYTES = 64 << 10


def frames(name: str, sealed: bytes) -> tuple[torch.Tensor, ...]:
    """The Gloo messages (uint8 tensors) that carry one control message: the frame, and the rest of
    a body too long for it."""
    encoded = name.encode()
    body = _BODY_LEN.pack(_NAME_LEN.size + len(encoded) + len(sealed)) + _NAME_LEN.pack(len(encoded))
    body += encoded + sealed
    data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    if data.shape[0] <= FRAME_BYTES:
        return (data,)
    return data[:FRAME_BYTES], data[FRAME_BYTES:]


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:200]


class OfferStore:
    """The newest offer message per name, at most `max_count` of them and `max_bytes` together: the
    oldest go first. Not locked: its owner's lock guards it."""

    def __init__(self, max_count: int = MAX_OFFERS_KEPT, max_bytes: int = MAX_OFFER_BYTES_KEPT) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._values: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._values)

    def put(self, name: str, value: bytes) -> None:
        self.take(name)
        self._values[name] = value
        self.num_bytes += len(value)
        while len(self._values) > self.max_count or self.num_bytes > self.max_bytes:
            self.num_bytes -= len(self._values.popitem(last=False)[1])

    def take(self, name: str) -> bytes | None:
        value = self._values.pop(name, None)
        if value is not None:
            self.num_bytes -= len(value)
        return value

    def peek(self, name: str) -> bytes | None:
        return self._values.get(name)


class ControlPlane:
    """The control messages of one channel generation over `group` (ranks 0 and 1).

    `on_gone(reason)` runs when the link fails under the threads. Methods take the protocol's
    message names ("bell/3").
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        rank: int,
        name: str,
        auth: ControlAuth,
        generation: int,
        on_gone: Callable[[str], None],
    ) -> None:
        self.group, self.rank, self.peer_rank, self.name = group, rank, 1 - rank, name
        self.auth, self.generation, self._on_gone = auth, generation, on_gone
        self.rejected = 0  # bodies that did not open: forged, replayed or garbage
        self._mailbox: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        # offer/{request id} -> the newest OFFER or RETRACTED for it: kept apart from the mailbox, whose
        # bound the messages of transfers in step stay far below; offers wait for their senders.
        self._offers = OfferStore()
        # Posted and not yet taken by the peer: (works, tensors they read, set once taken).
        self._outbox: collections.deque[tuple[list, tuple, threading.Event]] = collections.deque()
        # One lock guards both, and `_closed`; readers of the mailbox and the delivery thread wait on
        # conditions of their own, so that neither wakes the other for nothing.
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # a message filed, or closed
        self._sent = threading.Condition(lock)  # a message posted, or closed
        self._closed: str | None = None
        self._threads = [
            threading.Thread(target=self._read, name=f"control-in-{name}", daemon=True),
            threading.Thread(target=self._deliver, name=f"control-out-{name}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _full_name(self, rank: int, name: str) -> str:
        return self.auth.key(f"g{self.generation}/r{rank}/{name}")

    # ---- sending --------------------------------------------------------------------------------
    def send(self, name: str, value: bytes, *, wait_s: float = 0.0, optional: bool = False) -> bool:
        """Post one message to the peer, and wait up to `wait_s` for the peer to take it; returns
        whether it did by then. ChannelError if the link is closed or the peer took none of the last
        `MAX_PENDING` messages (the channel is then broken). An `optional` message (an offer) is not
        posted at all while `MAX_OPTIONAL_PENDING` sends wait for the peer: the call returns whether
        it was posted then."""
        tensors = frames(name, self.auth.seal(self._full_name(self.rank, name), value))
        taken, failure = threading.Event(), None
        with self._cond:  # a message's Gloo messages are posted back to back
            if self._closed is not None:
                raise ChannelError(f"channel {self.name}: {self._closed}")
            if optional and len(self._outbox) >= MAX_OPTIONAL_PENDING:
                return False
            if len(self._outbox) >= MAX_PENDING:
                failure = f"the peer took none of the last {MAX_PENDING} control messages"
            else:
                try:
                    works = [self.group.send([t], self.peer_rank, TAG_CONTROL) for t in tensors]
                    self._outbox.append((works, tensors, taken))
                    self._sent.notify()
                except Exception as exc:  # Gloo: a closed link
                    failure = f"sending {name}: peer or link failed: {first_line(exc)}"
        if failure is not None:
            raise self._gone(failure)
        return taken.wait(wait_s) if wait_s > 0 else (optional or taken.is_set())

    def _deliver(self) -> None:
        while True:
            with self._cond:
                while not self._outbox and self._closed is None:
                    self._sent.wait()
                if not self._outbox:
                    return
                works, _, taken = self._outbox[0]
            try:
                for work in works:
                    work.wait(delta(FOREVER_S))
            except Exception as exc:  # the link closed (ours or the peer's doing)
                self._lost(exc)
                return
            with self._cond:
                self._outbox.popleft()
            taken.set()

    # ---- receiving ------------------------------------------------------------------------------
    def wait_value(self, name: str, timeout_s: float) -> bytes | None:
        """Block until message `name` came (returned, and taken out of the mailbox) or `timeout_s`
        passes (None); ChannelError once the link is closed and the message did not come."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while name not in self._mailbox:
                if self._closed is not None:
                    raise ChannelError(f"channel {self.name}: {self._closed}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._mailbox.pop(name)

    def take_offer(self, name: str) -> bytes | None:
        """The newest offer message filed under `name` (taken out), or None; never waits."""
        with self._cond:
            return self._offers.take(name)

    def peek_offer(self, name: str) -> bytes | None:
        """The offer message filed under `name` (left there), or None."""
        with self._cond:
            return self._offers.peek(name)

    def holds(self, name: str) -> bool:
        """Whether message `name` came and was not read yet."""
        with self._cond:
            return name in self._mailbox

    def discard(self, *names: str) -> None:
        """Forget messages a finished transfer no longer reads (if they came)."""
        with self._cond:
            for name in names:
                self._mailbox.pop(name, None)

    def _read(self) -> None:
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)  # filled by one message at a time
        view = frame.numpy()
        while True:
            try:
                self.group.recv([frame], self.peer_rank, TAG_CONTROL).wait(delta(FOREVER_S))
                (size,) = _BODY_LEN.unpack_from(view)
                if not _NAME_LEN.size + MAC_BYTES <= size <= MAX_MESSAGE_BYTES:
                    raise ChannelError(f"a control message of {size} bytes")
                in_frame = min(size, FRAME_BYTES - _BODY_LEN.size)
                body = view[_BODY_LEN.size : _BODY_LEN.size + in_frame].tobytes()
                if size > in_frame:  # the rest of a long body follows, exactly its size
                    rest = torch.empty(size - in_frame, dtype=torch.uint8)
                    self.group.recv([rest], self.peer_rank, TAG_CONTROL).wait(delta(FOREVER_S))
                    body += rest.numpy().tobytes()
            except Exception as exc:  # the link closed (ours or the peer's doing), or out of step
                self._lost(exc)
                return
            self._file(body)

    def _file(self, body: bytes) -> None:
        (name_len,) = _NAME_LEN.unpack_from(body)
        name = body[_NAME_LEN.size : _NAME_LEN.size + name_len].decode(errors="replace")
        sealed = body[_NAME_LEN.size + name_len :]
        value = self.auth.open(self._full_name(self.peer_rank, name), sealed)
        with self._cond:
            if value is None:
                self.rejected += 1
                return
            if name.startswith(OFFER_PREFIX):  # nobody waits for one: a sender looks when it starts
                self._offers.put(name, value)
                return
            self._mailbox[name] = value
            while len(self._mailbox) > MAX_PENDING:
                self._mailbox.popitem(last=False)
            self._cond.notify_all()

    # ---- the end --------------------------------------------------------------------------------
    def close(self, reason: str) -> None:
        """Stop: every wait and send fails with `reason` from now on. The threads end once the
        channel closes the group's links (`join` waits for that)."""
        with self._cond:
            self._closed = self._closed or reason
            self._cond.notify_all()
            self._sent.notify_all()

    def join(self, timeout_s: float) -> None:
        for thread in self._threads:
            thread.join(timeout_s)

    def _lost(self, exc: Exception) -> None:
        """A thread's wait failed: the link closed. Unless this end closed it, the channel is broken."""
        with self._cond:
            if self._closed is not None:
                return
        self._gone(f"control link: peer or link failed: {first_line(exc)}")

    def _gone(self, reason: str) -> ChannelError:
        with self._cond:
            self._closed = self._closed or reason
            self._cond.notify_all()
            self._sent.notify_all()
        self._on_gone(reason)
        return ChannelError(f"channel {self.name}: {reason}")
