"""Control messages: anything at all that is not a valid message is a ProtocolError, never another type."""

import pickle

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distpool.memory.envelope import Envelope
from transfer.plans import UnitSizesDiffer
from transfer.plans.plan import plan_runs
from transfer.wire.errors import (
    LAYOUT,
    REFUSAL_PROBLEMS,
    HeaderRefused,
    ProtocolError,
    TrailerRefused,
    TransferError,
)
from transfer.wire.failure import FailureKind
from transfer.wire.protocol import (
    ABORT,
    HEADER,
    OFFER,
    PROTOCOL_VERSION,
    REFUSE,
    RETRACTED,
    STATUS,
    decode_message,
    encode_message,
    read_trailer,
    table_bytes,
    table_from_bytes,
    trailer,
)

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
        STATUS, seq=3, ok=False, failure=FailureKind.CORRUPT, reason="x" * 1000, broken=True, problem=""
    )
    message = decode_message(blob, expect=(STATUS,), max_bytes=4096)
    assert (message["seq"], message["ok"], message["broken"], len(message["reason"])) == (3, False, True, 300)
    assert FailureKind(message["failure"]) is FailureKind.CORRUPT


@pytest.mark.parametrize("problem", sorted(REFUSAL_PROBLEMS))
def test_every_refusal_problem_crosses_the_wire(problem):
    blob = encode_message(REFUSE, seq=2, failure=FailureKind.REFUSED, problem=problem, reason="why")
    assert decode_message(blob, expect=(REFUSE,), max_bytes=4096)["problem"] == problem
    # A header planned on an offer is refused in its STATUS, with the same problem.
    blob = encode_message(
        STATUS, seq=2, ok=False, failure=FailureKind.REFUSED, reason="why", broken=False, problem=problem
    )
    assert decode_message(blob, expect=(STATUS,), max_bytes=4096)["problem"] == problem


def test_an_offer_and_its_retraction_round_trip():
    table = table_bytes(torch.tensor([[0, 96], [4096, 64]], dtype=torch.int64))
    fields = dict(
        request_id="r", serial=3, num_tokens=48, num_rows=3, table=table, held=1, max_chunk_bytes=64
    )
    offer = decode_message(encode_message(OFFER, **fields), expect=(OFFER, RETRACTED), max_bytes=4096)
    assert {name: offer[name] for name in fields} == fields
    retracted = encode_message(RETRACTED, request_id="r", serial=3)
    assert decode_message(retracted, expect=(OFFER, RETRACTED), max_bytes=4096)["serial"] == 3
    with pytest.raises(ProtocolError):  # an offer with a serial of -1
        decode_message(encode_message(OFFER, **{**fields, "serial": -1}), expect=(OFFER,), max_bytes=4096)


def test_a_refused_header_pickles_with_its_facts_and_its_cause():
    cause = UnitSizesDiffer(rank=1, tp=2, kind="page", sizes=[8192], expected=4096)
    refused = HeaderRefused(FailureKind.REFUSED, LAYOUT, str(cause), cause=cause)
    error = TransferError("r", FailureKind.REFUSED, "refused", cause=refused, channel_broken=True)
    again = pickle.loads(pickle.dumps(error))
    assert (again.request_id, again.kind, again.reason, again.channel_broken) == (
        "r",
        FailureKind.REFUSED,
        "refused",
        True,
    )
    assert (again.cause.kind, again.cause.problem) == (FailureKind.REFUSED, LAYOUT)
    assert again.cause.detail == str(cause)
    assert vars(again.cause.cause) == vars(cause)


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        (REFUSE, {"failure": "sunspots", "problem": "layout", "reason": ""}),  # not a FailureKind
        (REFUSE, {"failure": "refused", "problem": "sunspots", "reason": ""}),  # not a problem
        (ABORT, {"failure": "", "reason": "no kind"}),
        (STATUS, {"ok": True, "failure": "timeout", "reason": "", "broken": False}),  # ok, yet failed
        (STATUS, {"ok": False, "failure": "", "reason": "why not", "broken": False}),  # failed, no kind
        # a refusal's problem on an ok STATUS, and one the protocol does not know
        (STATUS, {"ok": True, "failure": "", "reason": "", "broken": False, "problem": "layout"}),
        (STATUS, {"ok": False, "failure": "refused", "reason": "", "broken": False, "problem": "sunspots"}),
    ],
)
def test_a_failure_kind_or_problem_the_protocol_does_not_know_is_refused(kind, fields):
    if kind == STATUS:
        fields = {"problem": "", **fields}
    with pytest.raises(ProtocolError):
        decode_message(encode_message(kind, seq=1, **fields), expect=(kind,), max_bytes=4096)


# ---- the header: what crosses for an envelope (its source table among its fields) ---------------
ENVELOPE = Envelope(
    request_id="r",
    num_tokens=48,
    ranges=torch.tensor([[0, 96], [4096, 64], [1024, 64], [2048, 64]], dtype=torch.int64),
    has_slot=True,
    held_pages=1,
)


def header_of(envelope: Envelope) -> bytes:
    return encode_message(
        HEADER,
        version=PROTOCOL_VERSION,
        seq=1,
        request_id=envelope.request_id,
        num_tokens=envelope.num_tokens,
        first_token=7,
        table=table_bytes(envelope.ranges),
        chunk_bytes=1 << 20,
        direct_min_bytes=1 << 16,
        checksum=False,
        offer=0,
    )


def pair_with(envelope: Envelope, blob: bytes) -> object:
    """What the receiver does with a header before anything is written: decode it, read its table,
    plan the runs against its own envelope. Raises ProtocolError or ValueError for bad input."""
    header = decode_message(blob, expect=(HEADER,), max_bytes=4096)
    table = table_from_bytes(header["table"], num_rows=len(header["table"]) // 16)
    return plan_runs(envelope.moving_of(table), envelope.moving)


def test_a_header_pairs_the_source_table_with_the_envelope_less_its_held_pages():
    shifted = ENVELOPE.ranges + torch.tensor([8192, 0])  # the same rows, 8 KiB further up
    source = Envelope(request_id="r", num_tokens=48, ranges=shifted, has_slot=True)
    runs = pair_with(ENVELOPE, header_of(source))
    # the slot, then pages 1 and 2 (page 0 is held here), each at its own offset on both sides
    assert runs.tolist() == [[8192, 0, 96], [8192 + 1024, 1024, 64], [8192 + 2048, 2048, 64]]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_random_bytes_are_refused_as_a_protocol_error(data):
    with pytest.raises(ProtocolError):
        pair_with(ENVELOPE, data)


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_fuzz_mutated_headers_raise_only_protocol_or_value_errors(data):
    blob = bytearray(header_of(ENVELOPE))
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    try:
        pair_with(ENVELOPE, bytes(blob))
    except (ProtocolError, ValueError):
        pass


def test_the_trailer_reads_back_and_refuses_what_is_not_this_transfers():
    cpu = torch.device("cpu")
    assert read_trailer(trailer(5, filled=True, checksum=0xFFFFFFFF, device=cpu), 5) == (True, 0xFFFFFFFF)
    assert read_trailer(trailer(5, filled=False, checksum=None, device=cpu), 5) == (False, None)
    with pytest.raises(TrailerRefused) as out_of_step:  # another transfer's
        read_trailer(trailer(5, filled=True, checksum=None, device=cpu), 6)
    assert (out_of_step.value.seq, out_of_step.value.words, out_of_step.value.out_of_step) == (
        6,
        [5, 1, -1],
        True,
    )
    assert isinstance(out_of_step.value, ProtocolError)
    for garbage in ([5, 2, -1], [5, 1, 1 << 32], [5, 1, -2]):
        with pytest.raises(TrailerRefused) as refused:
            read_trailer(torch.tensor(garbage), 5)
        assert (refused.value.words, refused.value.out_of_step) == (garbage, False)
