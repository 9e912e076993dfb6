"""Outsiders on a channel's store: whatever they write, transfers complete, threads live, nothing leaks.

The channel's store port is reachable by anyone on the host. These scenarios play the outsider: one
that guesses the protocol's plain key names, one that somehow learned the real (secret-derived)
names but not the secret, and one that replays authentic messages into other keys.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess

import pytest
import torch.distributed as dist

from tests.transfer.test_engine_states import ARENA_BYTES, round_trip, tables
from tests.transfer.transfer_peer import make_arena
from transfer.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    bell_key,
    current_generation_key,
    encode_message,
    generation_counter_key,
    generation_prefix,
    join_key,
    reply_key,
)


def outsider(channel) -> dist.TCPStore:
    """A client of the channel's store that holds no secret."""
    return dist.TCPStore(channel.host, channel.port, None, False, datetime.timedelta(seconds=5))


def generation_keys(channel) -> dist.PrefixStore:
    """The outsider's view of the current generation, as if the secret-derived prefix had leaked."""
    prefix = channel.auth.key(generation_prefix(channel.name, channel.generation)) + "/"
    return dist.PrefixStore(prefix, outsider(channel))


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


def test_hostile_writes_on_guessable_key_names_change_nothing(pair):
    sender, receiver = pair
    name, junk = sender.channel.name, b"\x93garbage" + os.urandom(64)
    store = outsider(sender.channel)
    plain = [bell_key(s) for s in range(4)] + [reply_key(s) for s in range(4)]
    plain += [f"{generation_prefix(name, g)}{k}" for g in range(1, 4) for k in plain]
    for key in plain:
        store.set(key, junk)
    for key in (generation_counter_key(name), join_key(name, 2), join_key(name, 3)):
        store.add(key, 1)  # claims on the next generations
    store.set(current_generation_key(name), b"99")
    with socket.create_connection((sender.channel.host, sender.channel.port)) as raw:
        raw.sendall(os.urandom(4096))  # not even the store's protocol
    move_three(sender, receiver, "guessed")
    assert_unharmed(sender, receiver)
    # The outsider's claims did not stop a rebuild either.
    import threading

    rebuild = threading.Thread(target=receiver.connect)
    rebuild.start()
    sender.connect()
    rebuild.join()
    move_three(sender, receiver, "rebuilt")
    assert_unharmed(sender, receiver)


def test_forged_messages_under_leaked_key_names_are_dropped_and_counted(pair):
    """The outsider knows the real key names (say, from a leaked log) but not the secret."""
    sender, receiver = pair
    channel = receiver.channel
    store = generation_keys(channel)
    forged_header = a_header(0, "forged-0")
    seq = channel.transfer_seq
    for s in range(seq, seq + 3):
        store.set(channel.control._key(bell_key(s)), forged_header + os.urandom(32))  # a made-up MAC
        store.set(channel.control._key(reply_key(s)), os.urandom(48))
    move_three(sender, receiver, "forged")
    assert_unharmed(sender, receiver)
    assert receiver.channel.control.rejected >= 1 and sender.channel.control.rejected >= 1


def test_replayed_authentic_messages_are_refused_in_any_other_key(pair):
    """An authentic message copied into another key (the next sequence number) does not open there."""
    sender, receiver = pair
    channel = receiver.channel
    auth, control = channel.auth, channel.control
    store = generation_keys(channel)
    seq = channel.transfer_seq
    old_key = control._key(bell_key(seq - 1 if seq else seq + 5))
    authentic = auth.seal(old_key, a_header(seq, "replayed"))
    assert auth.open(old_key, authentic) is not None  # authentic where it was sealed...
    store.set(control._key(bell_key(seq)), authentic)  # ...replayed into the next bell
    move_three(sender, receiver, "replayed")
    assert_unharmed(sender, receiver)
    assert receiver.channel.control.rejected >= 1


@pytest.mark.parametrize("secret", [b"", b"short"])
def test_a_channel_refuses_to_run_unauthenticated(secret):
    from tests.transfer.transfer_peer import FINGERPRINT, LAYOUT
    from transfer import Channel

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


def test_the_store_listens_only_on_the_address_its_peer_uses(pair):
    sender, _ = pair
    port = sender.channel.port
    listing = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
    addresses = {line.split()[3].rsplit(":", 1)[0] for line in listing.splitlines()}
    assert addresses == {"127.0.0.1"}, listing  # not 0.0.0.0 or [::]: nothing off this host reaches it
