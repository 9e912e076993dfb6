"""Channels in one process: rendezvous, handshake, fingerprint refusal, timeouts and rebuilds."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from distpool.memory.sizing import TpEnd
from tests.transfer.transfer_peer import FINGERPRINT, LAYOUT, SECRET, free_port
from transfer import ArgInvalid, Channel, ChannelError, FailureKind, FingerprintMismatch


def make_channel(
    rank: int,
    port: int,
    *,
    layout: dict | None = None,
    fingerprint: str = FINGERPRINT,
    timeout_s: float = 5.0,
    name: str = "t",
    tp: TpEnd | None = None,
) -> Channel:
    return Channel(
        rank=rank,
        host="127.0.0.1",
        port=port,
        device="cpu",
        fingerprint=fingerprint,
        layout=LAYOUT if layout is None else layout,
        timeout_s=timeout_s,
        secret=SECRET,
        name=name,
        tp=tp,
    )


def connect_both(first: Channel, second: Channel) -> tuple[BaseException | None, BaseException | None]:
    """Connect two ends concurrently; return what each raised (None on success)."""
    errors: list[BaseException | None] = [None, None]

    def run(i: int, channel: Channel) -> None:
        try:
            channel.connect()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors[0], errors[1]


def exchange(sender: Channel, receiver: Channel, value: int) -> int:
    out, into = torch.full((4,), value, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    deadline = time.monotonic() + 5
    recv = receiver.recv(into, 1)
    sender.wait(sender.send(out, 1), deadline, "test send")
    receiver.wait(recv, deadline, "test recv")
    return int(into[0])


def test_connect_handshake_and_exchange():
    port = free_port()
    sender, receiver = make_channel(0, port), make_channel(1, port)
    assert connect_both(sender, receiver) == (None, None)
    assert sender.healthy and receiver.healthy
    assert sender.generation == receiver.generation == 1
    assert receiver.peer_hello["layout"] == LAYOUT and receiver.peer_hello["backend"] == "gloo"
    assert exchange(sender, receiver, 42) == 42
    sender.close()
    receiver.close()


def test_fingerprint_mismatch_names_the_differing_fields_on_both_ends():
    port = free_port()
    other_layout = {**LAYOUT, "page_size": 32, "kv_dtype": "float8_e4m3fn"}
    sender = make_channel(0, port)
    receiver = make_channel(1, port, layout=other_layout, fingerprint="0000000000000000")
    sender_error, receiver_error = connect_both(sender, receiver)
    for error in (sender_error, receiver_error):
        assert isinstance(error, FingerprintMismatch)
        assert sorted(error.fields) == ["fingerprint", "layout.kv_dtype", "layout.page_size"]
    assert sender_error.fields["layout.page_size"] == (16, 32)
    assert receiver_error.fields["layout.page_size"] == (32, 16)
    assert pickle.loads(pickle.dumps(sender_error)).fields == sender_error.fields  # Ray carries it
    assert not sender.healthy and not receiver.healthy
    # The side with the wrong layout comes back corrected: the same channel objects reconnect.
    receiver.layout, receiver.fingerprint = dict(LAYOUT), FINGERPRINT
    assert connect_both(sender, receiver) == (None, None)
    assert exchange(sender, receiver, 7) == 7
    sender.close()
    receiver.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_peer_that_never_shows_up_fails_connect_within_the_timeout(rank):
    channel = make_channel(rank, free_port(), timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(ChannelError):
        channel.connect()
    assert time.monotonic() - started < 30  # the timeout ended it, not a hang
    assert not channel.healthy
    channel.close()


def test_rebuild_makes_a_new_generation_and_leaves_other_channels_alone():
    port_a = free_port()
    a0, a1 = make_channel(0, port_a, name="a"), make_channel(1, port_a, name="a")
    assert connect_both(a0, a1) == (None, None)
    # b's port is picked only now: a's connections take ephemeral ports, and one of them could be
    # a port picked before (its store then fails to bind: "address already in use").
    port_b = free_port()
    b0, b1 = make_channel(0, port_b, name="b"), make_channel(1, port_b, name="b")
    assert connect_both(b0, b1) == (None, None)
    a0.mark_broken("test: pretend the link failed")
    assert not a0.healthy and b0.healthy
    assert connect_both(a0, a1) == (None, None)  # rebuild = connect again, both ends
    assert a0.generation == a1.generation == 2
    assert b0.generation == b1.generation == 1
    assert exchange(a0, a1, 1) == 1 and exchange(b0, b1, 2) == 2
    for channel in (a0, a1, b0, b1):
        channel.close()


def test_a_timed_out_wait_marks_the_channel_broken():
    port = free_port()
    sender, receiver = make_channel(0, port), make_channel(1, port)
    connect_both(sender, receiver)
    into = torch.zeros(4, dtype=torch.int64)
    started = time.monotonic()
    with pytest.raises(ChannelError) as failure:
        receiver.wait(receiver.recv(into, 1), time.monotonic() + 0.5, "nothing is coming")
    assert failure.value.kind is FailureKind.TIMEOUT
    assert time.monotonic() - started < 30
    assert not receiver.healthy
    assert connect_both(sender, receiver) == (None, None)
    assert exchange(sender, receiver, 3) == 3
    sender.close()
    receiver.close()


@pytest.mark.parametrize(
    "rank, port, timeout_s, field, value",
    [(2, 1234, 1.0, "rank", 2), (0, 1234, 0, "timeout_s", 0), (0, 70000, 1.0, "port", 70000)],
)
def test_bad_configuration_is_refused_naming_the_field_and_value(rank, port, timeout_s, field, value):
    with pytest.raises(ArgInvalid) as refused:
        make_channel(rank, port, timeout_s=timeout_s)
    assert (refused.value.field, refused.value.value) == (field, value)
    assert isinstance(refused.value, ValueError)
