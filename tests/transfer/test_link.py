"""The raw link measurement (`transfer.ends.link`): both ends at once, on the channel's own group."""

from __future__ import annotations

import threading

import pytest

from tests.transfer.test_engine_states import round_trip, tables
from tests.transfer.transfer_peer import make_arena
from transfer import ArgInvalid, ChannelError
from transfer.ends.link import measure


def measure_both(sender, receiver, nbytes: int, repeats: int, chunk_bytes: int | None = None):
    results: dict[str, object] = {}

    def on(side, end):
        try:
            results[side] = measure(end, nbytes, repeats, chunk_bytes)
        except Exception as exc:  # reported to the test
            results[side] = exc

    threads = [threading.Thread(target=on, args=(s, e)) for s, e in (("s", sender), ("r", receiver))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results["s"], results["r"]


def test_the_receiver_times_raw_messages_and_the_channel_still_moves_envelopes(pair):
    sender, receiver = pair
    sent, seconds = measure_both(sender, receiver, 8 << 20, 5, chunk_bytes=1 << 20)
    assert sent is None
    assert isinstance(seconds, float) and 0 < seconds < 5
    src, dst = tables(seed=3)
    arenas = make_arena(4 << 20, seed=1), make_arena(4 << 20, seed=2)
    round_trip(sender, receiver, "after-link", (arenas[0], src), (arenas[1], dst), has_slot=True)


def test_bad_sizes_are_refused_before_anything_moves(pair):
    sender, _ = pair
    for nbytes, repeats in ((0, 5), (8, 0), (5 << 30, 1)):
        with pytest.raises(ArgInvalid) as refused:
            measure(sender, nbytes, repeats)
        assert refused.value.value == (nbytes, repeats)


def test_a_peer_that_never_joins_fails_within_the_timeout(pair):
    _, receiver = pair
    with pytest.raises(ChannelError):
        measure(receiver, 1 << 20, 1)  # the sender never sends: the 5 s channel timeout ends it
