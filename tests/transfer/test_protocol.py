"""Control messages: anything at all that is not a valid message is a ProtocolError, never another type."""

import msgpack
import pytest

from transfer.errors import ProtocolError
from transfer.protocol import HEADER, STATUS, decode_message, encode_message

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
    blob = encode_message(STATUS, seq=3, ok=False, reason="x" * 1000, broken=True)
    message = decode_message(blob, expect=(STATUS,), max_bytes=4096)
    assert (message["seq"], message["ok"], message["broken"], len(message["reason"])) == (3, False, True, 300)
