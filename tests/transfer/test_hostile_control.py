"""Outsiders against a channel: its store is gone once it formed, and what reaches the link is dropped.

The rendezvous store listens only while a channel forms. These scenarios play the outsider: one
that finds the port after the channel formed (nothing listens), one that writes into the store
while a rebuild has it open (nothing it wrote survives the rebuild), and one that holds the pair's
link itself but not the secret (its forged and replayed control messages are dropped and counted).
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.transfer.test_engine_states import ARENA_BYTES, round_trip, tables
from tests.transfer.transfer_peer import FINGERPRINT, LAYOUT, SECRET, free_port, make_arena
from transfer import Channel
from transfer.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    TAG_CONTROL,
    bell_key,
    current_generation_key,
    encode_message,
    join_key,
    reply_key,
)


def outsider(channel, timeout_s: float = 2.0) -> dist.TCPStore:
    """A client of the channel's rendezvous store that holds no secret."""
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


def rebuild(sender, receiver) -> None:
    other = threading.Thread(target=receiver.connect)
    other.start()
    sender.connect()
    other.join()


def test_once_a_channel_formed_nothing_listens_on_its_port(pair):
    """Regression: the store stayed up for the channel's life, and any local process could fill the
    prefill worker's memory through it (512 keys of 1 MiB: +550 MB, never freed)."""
    sender, receiver = pair
    assert listening(sender.channel.port) == []
    with pytest.raises(Exception, match="(?i)connect|refused|timed? ?out"):
        outsider(sender.channel, timeout_s=1.0).set("junk", os.urandom(1 << 20))
    move_three(sender, receiver, "after")
    assert_unharmed(sender, receiver)


def test_what_an_outsider_writes_during_a_rebuild_is_gone_with_it(pair):
    """The store is open while a rebuild forms the next generation. An outsider that writes there,
    guessable protocol names included, neither stops the rebuild nor leaves a key behind, and its
    connection goes with the store."""
    sender, receiver = pair
    name = sender.channel.name
    written, stop = [], threading.Event()

    def flood() -> None:  # keeps connecting and writing, as fast as the port lets it
        while not stop.is_set():
            try:
                socket.create_connection((sender.channel.host, sender.channel.port), timeout=0.1).close()
                store = outsider(sender.channel, timeout_s=0.5)
                for key in (bell_key(0), reply_key(0), current_generation_key(name), join_key(name, 3)):
                    store.set(key, b"\x93garbage" + os.urandom(64))
                for i in range(64):
                    store.set(f"junk/{i}", os.urandom(64 << 10))
                    written.append(store.num_keys())
            except Exception:  # refused, or cut off when the store went: try again
                time.sleep(0.001)

    attacker = threading.Thread(target=flood, daemon=True)
    attacker.start()
    for _ in range(3):
        # Rank 1 comes late: the store waits for it, open to the outsider all that time.
        late = threading.Thread(target=lambda: (time.sleep(0.5), receiver.connect()))
        late.start()
        sender.connect()
        late.join()
        assert listening(sender.channel.port) == []
    stop.set()
    attacker.join(timeout=10)
    assert written, "the outsider never reached the store while it was open"
    # Every window had a fresh store: what the outsider saw never grew past one window's writes.
    assert max(written) <= 64 + 16
    move_three(sender, receiver, "rebuilt")
    assert_unharmed(sender, receiver)


def test_the_store_listens_only_on_the_address_its_peer_uses_and_only_while_forming():
    port = free_port()
    ends = [
        Channel(
            rank=r,
            host="127.0.0.1",
            port=port,
            device="cpu",
            fingerprint=FINGERPRINT,
            layout=LAYOUT,
            timeout_s=5,
            secret=SECRET,
            name="l",
        )
        for r in (0, 1)
    ]
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
    encoded = name.encode()
    body = len(encoded).to_bytes(2, "little") + encoded + sealed
    group, peer = channel._pg, channel.peer_rank
    for tensor in (
        torch.tensor([len(body)], dtype=torch.int64),
        torch.frombuffer(bytearray(body), dtype=torch.uint8),
    ):
        group.send([tensor], peer, TAG_CONTROL).wait(datetime.timedelta(seconds=5))


def test_forged_messages_on_the_link_are_dropped_and_counted(pair):
    sender, receiver = pair
    seq = sender.channel.transfer_seq
    for s in range(seq, seq + 3):
        send_raw(sender.channel, bell_key(s), a_header(s, f"forged-{s}") + os.urandom(32))  # a made-up MAC
        send_raw(receiver.channel, reply_key(s), os.urandom(48))
    move_three(sender, receiver, "forged")
    assert_unharmed(sender, receiver)
    assert receiver.channel.control.rejected == 3 and sender.channel.control.rejected == 3


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
    with pytest.raises(ValueError, match="at least 16 random bytes"):
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
