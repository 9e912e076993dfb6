"""The envelope wire format: round trips, and only EnvelopeError for anything malformed."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distpool.memory.envelope import ENVELOPE_VERSION, Envelope, EnvelopeError


def make_envelope(**overrides) -> Envelope:
    fields = dict(
        request_id="req-7",
        fingerprint="3f2a9c1d00aa11bb",
        page_ids=(12, 3, 44, 7),
        slot_id=5,
        num_tokens=60,
        num_bytes=4 * 4096 + 12288,
    )
    fields.update(overrides)
    return Envelope(**fields)


def test_round_trip_keeps_every_field():
    envelope = make_envelope()
    decoded = Envelope.decode(envelope.encode())
    assert decoded == envelope
    assert decoded.page_ids == (12, 3, 44, 7)
    assert decoded.num_pages == 4


def test_round_trip_without_slot_and_without_pages():
    envelope = make_envelope(slot_id=None, page_ids=(), num_tokens=0, num_bytes=0)
    assert Envelope.decode(envelope.encode()) == envelope


def test_encoding_is_versioned_positional_msgpack():
    fields = msgpack.unpackb(make_envelope().encode())
    assert fields == [ENVELOPE_VERSION, "req-7", "3f2a9c1d00aa11bb", [12, 3, 44, 7], 5, 60, 28672, 0]


def test_page_ids_from_a_list_are_stored_as_a_tuple():
    assert make_envelope(page_ids=[9, 8]).page_ids == (9, 8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"page_ids": (1, 2, 1)}, "duplicate"),
        ({"page_ids": (1, -2)}, "page ids must be in"),
        ({"page_ids": (1, True)}, "must hold ints"),
        ({"slot_id": -1}, "slot_id must be in"),
        ({"slot_id": True}, "slot_id must be an int"),
        ({"num_tokens": 3.0}, "num_tokens must be an int"),
        ({"num_bytes": -5}, "num_bytes must be in"),
        ({"request_id": ""}, "request_id must have"),
        ({"request_id": 7}, "request_id must be a str"),
        ({"fingerprint": "x" * 129}, "fingerprint must have"),
        ({"page_ids": "1234"}, "page_ids must be a sequence"),
        ({"held_pages": 5}, r"held_pages must be in \[0, 4\]"),
    ],
)
def test_construction_refuses_bad_values(overrides, message):
    with pytest.raises(EnvelopeError, match=message):
        make_envelope(**overrides)


def _encode_fields(fields: list) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


GOOD = [ENVELOPE_VERSION, "r", "fp", [1, 2], 0, 32, 8192, 1]


@pytest.mark.parametrize(
    "data, message",
    [
        (_encode_fields([1, *GOOD[1:]]), "version 1 is not supported"),
        (_encode_fields([True, *GOOD[1:]]), "version True"),
        (_encode_fields(GOOD[:-1]), "list of 8 fields, got 7 fields"),
        (_encode_fields([*GOOD, 0]), "list of 8 fields, got 9 fields"),
        (_encode_fields({"v": 1}), "max_map_len|list of 8 fields"),
        (_encode_fields([*GOOD[:3], [1, 2.5], *GOOD[4:]]), "must hold ints"),
        (_encode_fields([*GOOD[:3], [1, 1 << 63], *GOOD[4:]]), "page ids must be in"),
        (_encode_fields([*GOOD[:3], [1, False], *GOOD[4:]]), "must hold ints"),
        (_encode_fields([*GOOD[:3], "12", *GOOD[4:]]), "page_ids must be a list"),
        (_encode_fields([*GOOD[:3], [[1]], *GOOD[4:]]), "must hold ints"),
        (_encode_fields([*GOOD[:4], -1, *GOOD[5:]]), "slot_id must be in"),
        (_encode_fields([*GOOD[:5], None, *GOOD[6:]]), "num_tokens must be an int"),
        (_encode_fields([*GOOD[:7], 3]), r"held_pages must be in \[0, 2\]"),
        (_encode_fields([*GOOD[:7], -1]), "held_pages must be in"),
        (_encode_fields([*GOOD[:1], b"r", *GOOD[2:]]), "max_bin_len|request_id must be a str"),
        (_encode_fields(GOOD)[:-1], "undecodable"),
        (_encode_fields(GOOD) + b"\x00", "undecodable"),
        (b"", "undecodable"),
        (msgpack.packb([ENVELOPE_VERSION, "r", "fp", [1], msgpack.ExtType(5, b"x"), 1, 1, 0]), "undecodable"),
    ],
)
def test_decode_refuses_malformed_encodings(data, message):
    with pytest.raises(EnvelopeError, match=message):
        Envelope.decode(data)


@pytest.mark.parametrize("data", ["a string", 123, None, [1, 2], object()])
def test_decode_refuses_non_bytes(data):
    with pytest.raises(EnvelopeError, match="an encoded envelope is bytes"):
        Envelope.decode(data)


def test_decode_bounds_page_count_and_ids_and_input_size():
    encoded = make_envelope(page_ids=tuple(range(50))).encode()
    with pytest.raises(EnvelopeError, match="undecodable|at most 10"):
        Envelope.decode(encoded, max_pages=10)
    with pytest.raises(EnvelopeError, match=r"page ids must be in \[0, 40\]"):
        Envelope.decode(encoded, max_id=40)
    with pytest.raises(EnvelopeError, match="at most 16 allowed"):
        Envelope.decode(encoded, max_encoded_bytes=16)
    huge = b"\xdd\xff\xff\xff\xff"  # an array header claiming 4 billion entries, then nothing
    with pytest.raises(EnvelopeError, match="undecodable"):
        Envelope.decode(huge)


def test_decode_accepts_memoryview_and_bytearray():
    encoded = make_envelope().encode()
    assert Envelope.decode(memoryview(encoded)) == Envelope.decode(bytearray(encoded)) == make_envelope()


# ---- fuzzing: thousands of inputs, only EnvelopeError ever comes out -------------------------------
def _decode_or_envelope_error(data: object) -> None:
    try:
        decoded = Envelope.decode(data)
    except EnvelopeError:
        return
    # Whatever decodes is a valid envelope that survives its own round trip.
    assert Envelope.decode(decoded.encode()) == decoded


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=8) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(msgpack_values, min_size=0, max_size=9))
def test_fuzz_structured_garbage(fields):
    _decode_or_envelope_error(msgpack.packb(fields, use_bin_type=True))


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data):
    _decode_or_envelope_error(data)


@settings(max_examples=500, deadline=None)
@given(
    st.text(min_size=1, max_size=40),
    st.lists(st.integers(0, 2**62 - 1), max_size=50, unique=True),
    st.none() | st.integers(0, 2**62 - 1),
    st.integers(0, 2**40),
)
def test_fuzz_valid_envelopes_round_trip(request_id, page_ids, slot_id, num_bytes):
    envelope = Envelope(
        request_id=request_id,
        fingerprint="fp",
        page_ids=page_ids,
        slot_id=slot_id,
        num_tokens=16 * len(page_ids),
        num_bytes=num_bytes,
    )
    assert Envelope.decode(envelope.encode()) == envelope


def test_fuzz_mutated_valid_encodings():
    rng = random.Random(1234)
    encodings = [
        make_envelope(page_ids=tuple(rng.sample(range(10**6), k)), slot_id=rng.choice([None, 3])).encode()
        for k in (0, 1, 5, 40, 300)
    ]
    num_decoded = 0
    for _ in range(6000):
        data = bytearray(rng.choice(encodings))
        for _ in range(rng.randint(1, 4)):
            action = rng.random()
            if action < 0.5 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)  # flip a byte
            elif action < 0.7 and data:
                del data[rng.randrange(len(data)) :]  # truncate
            elif action < 0.85:
                position = rng.randrange(len(data) + 1)
                data[position:position] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            elif data:
                start = rng.randrange(len(data))
                del data[start : start + rng.randint(1, 8)]
        try:
            Envelope.decode(bytes(data))
            num_decoded += 1
        except EnvelopeError:
            pass
    # Some mutations (e.g. of a page id's digits) still decode; most must be refused.
    assert 0 < num_decoded < 6000
