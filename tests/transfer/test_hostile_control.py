"""Outsiders against a channel: its port listens only while it forms, and proves who may join.

These scenarios play the outsider: one that finds the port after the channel formed (nothing
listens), one that reaches it while a rebuild waits for rank 1 (whatever it sends, or withholds,
gets it dropped, and the rebuild goes on), one that listens on the port in rank 0's place (rank 1
refuses it), and one that holds the pair's link itself but not the secret (its forged and replayed
control messages are dropped and counted).
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

from tests.transfer.test_channel import make_channel
from tests.transfer.test_engine_states import ARENA_BYTES, round_trip, tables
from tests.transfer.transfer_peer import FINGERPRINT, LAYOUT, free_port, make_arena
from transfer import ArgInvalid, Channel
from transfer.connect import SecretNotProven
from transfer.connect.rendezvous import MAX_UNPROVEN
from transfer.pair.control import frames
from transfer.wire.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    TAG_CONTROL,
    bell_key,
    encode_message,
    offer_key,
    reply_key,
)


def outsider(channel, timeout_s: float = 2.0) -> dist.TCPStore:
    """A TCPStore client at the channel's port, as against the store it once served."""
    return dist.TCPStore(channel.host, channel.port, None, False, datetime.timedelta(seconds=timeout_s))


def listening(port: int) -> list[str]:
    """The addresses something listens on at `port` now."""
    listing = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return [line.split()[3].rsplit(":", 1)[0] for line in listing.splitlines()]


def a_header(seq: int, request_id: str) -> bytes:
    """A well-formed header (unsealed), as an outsider who read the protocol would write it."""
    return encode_message(
        HEADER,
        version=PROTOCOL_VERSION,
        seq=seq,
        request_id=request_id,
        num_tokens=16,
        first_token=0,
        table=b"\x00" * 16,
        chunk_bytes=1 << 20,
        direct_min_bytes=1 << 20,
        checksum=False,
        offer=0,
    )


def move_three(sender, receiver, stem: str) -> None:
    """Three envelopes, each checked byte for byte on arrival."""
    for i in range(3):
        src, dst = tables(seed=40 + i)
        source = (make_arena(ARENA_BYTES, seed=2 * i), src)
        destination = (make_arena(ARENA_BYTES, seed=2 * i + 1), dst)
        round_trip(sender, receiver, f"{stem}-{i}", source, destination, has_slot=True)


def assert_unharmed(sender, receiver) -> None:
    assert sender.channel.healthy and receiver.channel.healthy
    assert sender._thread.is_alive() and receiver._thread.is_alive()


def test_once_a_channel_formed_nothing_listens_on_its_port(pair):
    """Regression: the rendezvous store stayed up for the channel's life."""
    sender, receiver = pair
    assert listening(sender.channel.port) == []
    with pytest.raises(Exception, match="(?i)connect|refused|timed? ?out"):
        outsider(sender.channel, timeout_s=1.0).set("junk", os.urandom(1 << 20))
    move_three(sender, receiver, "after")
    assert_unharmed(sender, receiver)


def rebuild_with_rank1_late(sender, receiver, late_s: float) -> None:
    """Rebuild the channel, rank 1 arriving `late_s` late: rank 0 listens all that time."""
    late = threading.Thread(target=lambda: (time.sleep(late_s), receiver.connect()))
    late.start()
    sender.connect()
    late.join()


def test_whatever_an_outsider_sends_during_a_rebuild_gets_it_dropped(pair):
    """Regression: the rendezvous stored whatever anyone wrote (512 keys of 1 MiB: +550 MB, never
    freed). Now a connection must prove the secret within its first 64 bytes: the store's protocol,
    a wrong proof, a megabyte of junk, or silence all end in the connection being closed."""
    sender, receiver = pair
    port, nonces, closed = sender.channel.port, [], []

    def outsider_connection(send: bytes | None) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            nonces.append(sock.recv(64))
            try:
                if send is not None:
                    sock.sendall(send)
                closed.append(sock.recv(64) == b"")  # rank 0 hangs up rather than answer
            except OSError:  # reset: hung up on, with our bytes unread
                closed.append(True)

    def attack() -> None:
        time.sleep(0.1)  # rank 0 listens by now
        guesses = [
            None,  # says nothing: dropped after PROOF_S
            os.urandom(64),  # a proof made up
            os.urandom(1 << 20),  # junk, far more than a proof
            b"\x00" * 8 + b"validate" + os.urandom(48),  # something like the TCPStore protocol
        ]
        threads = [threading.Thread(target=outsider_connection, args=(g,)) for g in guesses]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    attacker = threading.Thread(target=attack)
    attacker.start()
    rebuild_with_rank1_late(sender, receiver, late_s=0.5)
    attacker.join(timeout=10)
    assert len(nonces) == 4 and all(len(n) == 32 for n in nonces)  # each got a fresh challenge...
    assert len(set(nonces)) == 4
    assert closed == [True] * 4  # ...and was hung up on
    assert listening(port) == []
    move_three(sender, receiver, "rebuilt")
    assert_unharmed(sender, receiver)


def test_stalled_outsiders_cannot_keep_rank_1_out(pair):
    """More connections than rank 0 keeps while they prove themselves, all silent: the oldest make
    room, and rank 1 joins."""
    sender, receiver = pair
    held: list[socket.socket] = []

    def crowd() -> None:
        time.sleep(0.1)
        for _ in range(2 * MAX_UNPROVEN):
            try:
                held.append(socket.create_connection(("127.0.0.1", sender.channel.port), timeout=1))
            except OSError:  # rank 0 stopped listening: rank 1 is in
                return

    crowding = threading.Thread(target=crowd)
    crowding.start()
    rebuild_with_rank1_late(sender, receiver, late_s=0.4)
    crowding.join(timeout=10)
    assert len(held) > MAX_UNPROVEN
    for sock in held:
        sock.close()
    move_three(sender, receiver, "crowded")
    assert_unharmed(sender, receiver)


def test_rank_1_refuses_a_rank_0_that_does_not_hold_the_secret():
    """An outsider listening on the port in rank 0's place cannot show the proof."""
    port = free_port()
    impostor = socket.create_server(("127.0.0.1", port))

    def pose() -> None:
        conn, _ = impostor.accept()
        with conn:
            conn.sendall(os.urandom(32))
            conn.recv(64)
            conn.sendall(os.urandom(32))  # a made-up proof
            time.sleep(1)

    posing = threading.Thread(target=pose)
    posing.start()
    channel = make_channel(1, port, timeout_s=3, name="i")
    with pytest.raises(SecretNotProven) as refused:
        channel.connect()
    assert refused.value.port == port
    posing.join()
    impostor.close()
    channel.close()


def test_the_store_listens_only_on_the_address_its_peer_uses_and_only_while_forming():
    port = free_port()
    ends = [make_channel(r, port, name="l") for r in (0, 1)]
    forming = threading.Thread(target=ends[0].connect)
    forming.start()  # rank 0 alone: its store waits for rank 1
    time.sleep(0.5)
    # Not 0.0.0.0 or [::]: nothing off this host reaches it.
    assert listening(port) == ["127.0.0.1"]
    ends[1].connect()
    forming.join()
    assert ends[0].healthy and ends[1].healthy
    assert listening(port) == []
    for end in ends:
        end.close()


def send_raw(channel, name: str, sealed: bytes) -> None:
    """What a holder of the pair's link (not of the secret) could put on it: one control frame."""
    group, peer = channel._pg, channel.peer_rank
    for tensor in frames(name, sealed):
        group.send([tensor], peer, TAG_CONTROL).wait(datetime.timedelta(seconds=5))


def test_forged_messages_on_the_link_are_dropped_and_counted(pair):
    sender, receiver = pair
    seq = sender.channel.transfer_seq
    for s in range(seq, seq + 3):
        send_raw(sender.channel, bell_key(s), a_header(s, f"forged-{s}") + os.urandom(32))  # a made-up MAC
        send_raw(receiver.channel, reply_key(s), os.urandom(48))
        send_raw(receiver.channel, offer_key(f"forged-{s}"), os.urandom(48))  # an offer, unsealed
    move_three(sender, receiver, "forged")
    assert_unharmed(sender, receiver)
    assert receiver.channel.control.rejected == 3 and sender.channel.control.rejected == 6
    assert all(
        sender.channel.control.peek_offer(offer_key(f"forged-{s}")) is None for s in range(seq, seq + 3)
    )


def test_replayed_authentic_messages_are_refused_under_any_other_name(pair):
    """A sealed message copied under another name, another direction or another generation does
    not open there."""
    sender, receiver = pair
    auth, channel = sender.channel.auth, sender.channel
    seq, generation = channel.transfer_seq, channel.generation
    header = a_header(seq, "replayed")
    wrong_seq = auth.seal(auth.key(f"g{generation}/r0/{bell_key(seq + 5)}"), header)
    wrong_rank = auth.seal(auth.key(f"g{generation}/r1/{bell_key(seq)}"), header)
    wrong_generation = auth.seal(auth.key(f"g{generation - 1}/r0/{bell_key(seq)}"), header)
    for sealed in (wrong_seq, wrong_rank, wrong_generation):
        send_raw(channel, bell_key(seq), sealed)
    move_three(sender, receiver, "replayed")
    assert_unharmed(sender, receiver)
    assert receiver.channel.control.rejected == 3


@pytest.mark.parametrize("secret", [b"", b"short"])
def test_a_channel_refuses_to_run_unauthenticated(secret):
    with pytest.raises(ArgInvalid) as refused:
        Channel(
            rank=0,
            host="127.0.0.1",
            port=1234,
            device="cpu",
            fingerprint=FINGERPRINT,
            layout=LAYOUT,
            timeout_s=1,
            secret=secret,
        )
    assert (refused.value.field, refused.value.value) == ("the secret's length", len(secret))
