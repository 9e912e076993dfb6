"""What crosses between the two ends, and what a failure is called: the words both ends share.

`protocol.py`: the control messages (HEADER, READY, REFUSE, ...), their keys and tags, msgpack
encoding and the row tables; `failure.py`: `FailureKind`, the kinds every failure carries (by value
on the wire); `errors.py`: the typed errors of the transfer path (`TransferError`, `ChannelError`,
`ProtocolError`, `FingerprintMismatch`, `ReshardRefused`).
"""

from transfer.wire.errors import (
    ChannelError,
    FingerprintMismatch,
    ProtocolError,
    ReshardRefused,
    TransferError,
)
from transfer.wire.failure import FailureKind
from transfer.wire.protocol import (
    ABORT,
    GENERATION_KEY,
    HEADER,
    PROTOCOL_VERSION,
    READY,
    REFUSE,
    STATUS,
    TAG_CLOSE,
    TAG_CONTROL,
    TAG_DATA,
    TAG_LINK_GO,
    TAG_LINK_PAYLOAD,
    TRAILER_WORDS,
    WITHDRAWN,
    abort_key,
    bell_key,
    decode_message,
    encode_message,
    hello_key,
    read_trailer,
    reply_key,
    status_key,
    table_bytes,
    table_from_bytes,
    trailer,
    withdraw_key,
)

__all__ = [
    "ABORT",
    "ChannelError",
    "FailureKind",
    "FingerprintMismatch",
    "GENERATION_KEY",
    "HEADER",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "READY",
    "REFUSE",
    "ReshardRefused",
    "STATUS",
    "TAG_CLOSE",
    "TAG_CONTROL",
    "TAG_DATA",
    "TAG_LINK_GO",
    "TAG_LINK_PAYLOAD",
    "TRAILER_WORDS",
    "TransferError",
    "WITHDRAWN",
    "abort_key",
    "bell_key",
    "decode_message",
    "encode_message",
    "hello_key",
    "read_trailer",
    "reply_key",
    "status_key",
    "table_bytes",
    "table_from_bytes",
    "trailer",
    "withdraw_key",
]
