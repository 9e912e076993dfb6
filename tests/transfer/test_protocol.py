"""Control messages: anything at all that is not a valid message is a ProtocolError, never another type."""

import msgpack
import pytest

from transfer.errors import ProtocolError
from transfer.failure import FailureKind
from transfer.protocol import ABORT, HEADER, REFUSE, STATUS, decode_message, encode_message

HOSTILE = [
    None,
    5,
    "text",
    b"",
    b"\xc1",  # a byte msgpack never uses
    msgpack.packb({"kind": "header", b"x": 1}, use_bin_type=True),  # text and byte-string keys mixed
    msgpack.packb({"kind": ["header"]}, use_bin_type=True),  # an unhashable kind
    msgpack.packb([1, 2, 3], use_bin_type=True),
    msgpack.packb({"kind": "status", "seq": -1, "ok": True, "reason": "", "broken": False}),
    msgpack.packb({"kind": "status", "seq": 1, "ok": 1, "reason": "", "broken": False}),
    b"\x00" * 10_000,
]


@pytest.mark.parametrize("blob", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_control_messages_raise_protocol_error_only(blob):
    with pytest.raises(ProtocolError):
        decode_message(blob, expect=(HEADER, STATUS), max_bytes=4096)


def test_a_valid_message_round_trips():
    blob = encode_message(
        STATUS, seq=3, ok=False, failure=FailureKind.CORRUPT, reason="x" * 1000, broken=True
    )
    message = decode_message(blob, expect=(STATUS,), max_bytes=4096)
    assert (message["seq"], message["ok"], message["broken"], len(message["reason"])) == (3, False, True, 300)
    assert FailureKind(message["failure"]) is FailureKind.CORRUPT


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        (REFUSE, {"failure": "sunspots", "reason": ""}),  # not a FailureKind
        (ABORT, {"failure": "", "reason": "no kind"}),
        (STATUS, {"ok": True, "failure": "timeout", "reason": "", "broken": False}),  # ok, yet failed
        (STATUS, {"ok": False, "failure": "", "reason": "why not", "broken": False}),  # failed, no kind
    ],
)
def test_a_failure_kind_the_protocol_does_not_know_is_refused(kind, fields):
    with pytest.raises(ProtocolError):
        decode_message(encode_message(kind, seq=1, **fields), expect=(kind,), max_bytes=4096)
