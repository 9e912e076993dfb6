"""The wire protocol of one transfer: control messages and payload, both over the pair's own link.

    sender                                              receiver
                                                    <-  offer/{request id} := OFFER (dest. table),
                                                        sent when the destination is reserved
    bell/{seq}   := HEADER (source table, first token,
                    the OFFER it planned on or 0)   ->  (waiting for bell/{seq})
                    planned on no offer: wait for   <-  reply/{seq} := READY (dest. table) | REFUSE
    group: the plan's messages, in order            ->  keeps receives posted ahead of them
    group: the trailer (seq, filled, checksum)      ->  read once its receives completed
    abort/{seq}  := ABORT (failure), only where the trailer says unfilled ->
                                                    <-  status/{seq} := STATUS (ok | failure, broken)

A receiver offers its destination as soon as it is reserved (OFFER: its table, held pages, tokens,
rows and chunk limit), and takes the offer back (RETRACTED, under the same name) if the reservation
ends before a transfer came. A sender that holds an offer its envelope pairs with plans on it and
sends its payload right after the header: the header -> READY round trip is gone from the
transfer's path. A header planned on an offer is never answered: the receiver either receives its
payload, or (the reservation went meanwhile, or a later offer replaced it) receives and discards
it, and its STATUS names the refusal's problem. A sender without a usable offer waits for READY, as
before. The sender keeps the newest offer per request, at most `MAX_OFFERS_KEPT` of them and
`MAX_OFFER_BYTES_KEPT` bytes (a table is 16 bytes a row); the receiver
remembers the offers it made, at most `MAX_OFFERS_MADE`, so that it can always discard a payload
planned on one.

A failure travels as its kind (a `FailureKind` value, which the other end reads) and a reason (a
sentence for a person, truncated to MAX_REASON_CHARS); a REFUSE also names what about the header it
refused (a `HeaderRefused` problem).

A sender whose deadline passes before the reply comes sends withdraw/{seq} := WITHDRAWN and fails
its transfer; the receiver, if it has not answered yet, answers REFUSE, and the channel stays in
step (an answer that crossed the withdrawal breaks the channel instead).

Control messages are sealed and framed by `transfer.pair.control` on their own tag; a wait for one can
time out without harming anything, and a garbled message costs a refusal, not the channel. Payload
messages carry no framing at all: both ends derive their sizes from the same plan. An abort still
completes the stream (the sender stops gathering, the receiver stops scattering), which keeps the
two ends in step without a control message in the group.

The stream ends with a *trailer* (`trailer`, three int64 on the payload's device, on stream 0): the
transfer's sequence number, whether the stream went out filled, and its CRC-32 (-1 where none was
asked). It takes the place of a control message after the payload: the receiver's own thread reads
it among its receives, where a control message costs a sealed post, the peer's reader thread and a
second wake-up. Only an unfilled stream is followed by an ABORT on the control link, which says why.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from transfer.wire.errors import REFUSAL_PROBLEMS, ProtocolError, TrailerRefused
from transfer.wire.failure import WIRE_VALUES, FailureKind

# 10: OFFER / RETRACTED, a header names the offer it planned on, STATUS names a refusal's problem;
# 9: REFUSE names its problem, and a batch's long stretches go as messages of their own (both ends
# must cut the same messages); 8: the stream ends with a trailer, no END message.
PROTOCOL_VERSION = 10
MAX_REASON_CHARS = 300

HEADER, READY, REFUSE, WITHDRAWN, ABORT, STATUS, OFFER, RETRACTED = (
    "header",
    "ready",
    "refuse",
    "withdrawn",
    "abort",
    "status",
    "offer",
    "retracted",
)

_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    HEADER: {
        "version": int,
        "seq": int,
        "request_id": str,
        "num_tokens": int,
        "first_token": int,  # what prefill generated: decode's first token
        "table": bytes,  # (n, 2) int64 source ranges, raw: the one description of the source
        "chunk_bytes": int,
        "direct_min_bytes": int,
        "checksum": bool,
        "offer": int,  # the serial of the OFFER the sender planned on; 0: none, it waits for READY
    },
    # held: the destination holds the envelope's first `held` pages; table lists the rows it takes
    READY: {"seq": int, "table": bytes, "held": int},
    # failure: a FailureKind's value, what the peer reads; reason: the same for a person;
    # problem: what about the header was refused (a `HeaderRefused` problem)
    REFUSE: {"seq": int, "failure": str, "problem": str, "reason": str},
    WITHDRAWN: {"seq": int, "reason": str},
    ABORT: {"seq": int, "failure": str, "reason": str},
    # broken: the receiver tore down; failure is "" exactly when ok; problem: a header planned on an
    # offer was refused (a `HeaderRefused` problem), else ""
    STATUS: {"seq": int, "ok": bool, "failure": str, "reason": str, "broken": bool, "problem": str},
    # serial: numbered by the receiver from 1; num_rows: the envelope's rows, held ones included;
    # table: the rows it takes (as READY's); max_chunk_bytes: the largest chunk it accepts
    OFFER: {
        "request_id": str,
        "serial": int,
        "num_tokens": int,
        "num_rows": int,
        "table": bytes,
        "held": int,
        "max_chunk_bytes": int,
    },
    RETRACTED: {"request_id": str, "serial": int},
}

# Control messages (transfer.pair.control) go with TAG_CONTROL. A payload message goes with TAG_DATA + its
# stream (MessagePlan.streams; Gloo: one connection per stream).
TAG_CONTROL, TAG_DATA = 0, 1
# The raw link measurement (transfer.ends.link): its payload goes with TAG_LINK_PAYLOAD + stream, far
# above any transfer's tags.
TAG_LINK_GO, TAG_LINK_PAYLOAD = (1 << 20) - 1, 1 << 20
# Nothing is ever sent with TAG_CLOSE + i: a receive on it that times out makes Gloo close the
# group's connections on device i (transfer.pair.channel.close_links).
TAG_CLOSE = 1 << 21


# ---- message names and rendezvous store keys: every one the protocol uses lives here -----------
def bell_key(seq: int) -> str:
    return f"bell/{seq}"


def reply_key(seq: int) -> str:
    return f"reply/{seq}"


def abort_key(seq: int) -> str:
    return f"abort/{seq}"


def status_key(seq: int) -> str:
    return f"status/{seq}"


def withdraw_key(seq: int) -> str:
    return f"withdraw/{seq}"


OFFER_PREFIX = "offer/"
# Offers a sender keeps (the newest per request; the oldest go first), and offers a receiver
# remembers having made (to discard a payload planned on one that is gone here).
MAX_OFFERS_KEPT, MAX_OFFER_BYTES_KEPT = 1024, 64 << 20
MAX_OFFERS_MADE = 4096


def offer_key(request_id: str) -> str:
    """Where a receiver's OFFER or RETRACTED for a request goes (the newest replaces the last)."""
    return f"{OFFER_PREFIX}{request_id}"


# Rendezvous store keys: the generation rank 0 numbered, and each end's hello.
GENERATION_KEY = "generation"


def hello_key(rank: int) -> str:
    return f"hello/{rank}"


def encode_message(kind: str, **fields: Any) -> bytes:
    """A msgpack map of `kind` and `fields` (a reason is truncated to MAX_REASON_CHARS, a failure
    kind goes as its value)."""
    if "reason" in fields:
        fields["reason"] = str(fields["reason"])[:MAX_REASON_CHARS]
    if isinstance(fields.get("failure"), FailureKind):
        fields["failure"] = fields["failure"].value
    return msgpack.packb({"kind": kind, **fields}, use_bin_type=True)


def decode_message(blob: object, *, expect: tuple[str, ...], max_bytes: int) -> dict[str, Any]:
    """Parse and validate a message whose kind must be one of `expect`; raise ProtocolError (and
    nothing else) for any input at all."""
    if not isinstance(blob, (bytes, bytearray)):
        raise ProtocolError(f"a {'/'.join(expect)} message must be bytes, got {type(blob).__name__}")
    if len(blob) > max_bytes:
        raise ProtocolError(
            f"a {'/'.join(expect)} message of {len(blob)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        fields = msgpack.unpackb(
            blob,
            raw=False,
            strict_map_key=True,
            max_ext_len=0,
            max_array_len=0,
            max_map_len=16,
            max_bin_len=max_bytes,
            max_str_len=4 * MAX_REASON_CHARS,
        )
    except Exception as exc:  # msgpack raises many types for garbage
        raise ProtocolError(f"undecodable {'/'.join(expect)} message: {type(exc).__name__}: {exc}") from None
    kind = fields.get("kind") if type(fields) is dict else None
    if kind not in expect:
        raise ProtocolError(
            f"expected a {' or '.join(expect)} message, got {kind or type(fields).__name__!r}"
        )
    spec = _FIELDS[kind]
    if set(fields) != set(spec) | {"kind"}:  # keys may be of mixed types: never sort them raw
        raise ProtocolError(f"{kind} message has fields {sorted(map(repr, fields))}, expected {sorted(spec)}")
    for name, allowed in spec.items():
        value = fields[name]
        if isinstance(value, bool) != (allowed is bool) or not isinstance(value, allowed):
            raise ProtocolError(f"{kind} message field {name} has type {type(value).__name__}")
        if type(value) is int and value < 0:
            raise ProtocolError(f"{kind} message field {name} is negative ({value})")
    if (
        "failure" in spec
        and fields["failure"] not in WIRE_VALUES
        and (fields["failure"], kind) != ("", STATUS)
    ):
        raise ProtocolError(f"{kind} message names no known failure kind: {fields['failure'][:40]!r}")
    if kind == REFUSE and fields["problem"] not in REFUSAL_PROBLEMS:
        raise ProtocolError(f"a REFUSE message names no known problem: {fields['problem'][:40]!r}")
    if kind == STATUS and fields["problem"] and (fields["problem"] not in REFUSAL_PROBLEMS or fields["ok"]):
        raise ProtocolError(f"a STATUS message names no refusal it could have: {fields['problem'][:40]!r}")
    if kind == STATUS and (fields["failure"] == "") != fields["ok"]:
        raise ProtocolError("a STATUS message names a failure kind exactly when it is not ok")
    return fields


def table_bytes(ranges: torch.Tensor) -> bytes:
    """An (n, 2) int64 range table as n * 16 raw bytes."""
    return ranges.contiguous().numpy().tobytes()


def table_from_bytes(raw: bytes, *, num_rows: int) -> torch.Tensor:
    """The inverse of `table_bytes`, refusing a table of the wrong size (values are checked by the plan)."""
    if len(raw) != num_rows * 16:
        raise ProtocolError(
            f"a range table of {len(raw)} bytes, expected {num_rows} rows ({num_rows * 16} bytes)"
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.int64).view(num_rows, 2)


# ---- the trailer: the stream's last payload message -----------------------------------------------
TRAILER_WORDS = 3  # (seq, filled, checksum) as int64
NO_CHECKSUM = -1


def trailer(seq: int, *, filled: bool, checksum: int | None, device: torch.device) -> torch.Tensor:
    """The trailer the sender posts after every payload message of transfer `seq`."""
    words = [seq, int(filled), NO_CHECKSUM if checksum is None else checksum]
    return torch.tensor(words, dtype=torch.int64, device=device)


def read_trailer(received: torch.Tensor, seq: int) -> tuple[bool, int | None]:
    """(filled, checksum or None) of a received trailer; TrailerRefused unless it is transfer `seq`'s
    (the stream is out of step, or not a trailer at all)."""
    got_seq, filled, checksum = received.tolist()
    if got_seq != seq or filled not in (0, 1) or not NO_CHECKSUM <= checksum < 1 << 32:
        raise TrailerRefused(seq, [got_seq, filled, checksum])
    return bool(filled), None if checksum == NO_CHECKSUM else checksum
