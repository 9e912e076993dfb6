"""Which ranks of a prefill and a decode group hold a channel, and what the ranks are called."""

from __future__ import annotations

import pytest

from distpool.model.shard import TpUnshardable
from distpool.worker.tp_pairing import TpPairing, rank_name
from tests.factories import tp_spec


def test_a_rank_of_tp_1_goes_by_its_workers_name():
    assert rank_name("decode-0", 0, 1) == "decode-0"
    assert [rank_name("decode-0", r, 2) for r in range(2)] == ["decode-0.0", "decode-0.1"]


@pytest.mark.parametrize(
    "sizes, channels",
    [
        ((1, 1), ((0, 0),)),
        ((2, 2), ((0, 0), (1, 1))),
        ((2, 1), ((0, 0), (1, 0))),  # the one decode rank needs both halves
        ((1, 2), ((0, 0), (0, 1))),
        ((2, 4), ((0, 0), (0, 1), (1, 2), (1, 3))),
    ],
)
def test_each_destination_rank_has_a_channel_to_the_source_ranks_its_shard_needs(sizes, channels):
    pairing = TpPairing(tp_spec("mamba2_groups8"), *sizes)
    assert pairing.channels == channels


def test_each_rank_names_its_peers_in_the_other_group():
    pairing = TpPairing(tp_spec("mamba2_groups8"), 2, 4)
    assert pairing.peer_names("prefill", 1, "decode-3") == ["decode-3.2", "decode-3.3"]
    assert pairing.peer_names("decode", 3, "prefill-0") == ["prefill-0.1"]
    assert TpPairing(tp_spec("mamba2_groups8"), 2, 1).peer_names("decode", 0, "prefill-0") == [
        "prefill-0.0",
        "prefill-0.1",
    ]


def test_a_tp_size_the_model_cannot_shard_is_refused():
    with pytest.raises(TpUnshardable) as refused:
        TpPairing(tp_spec("mamba2_groups8"), 1, 3)
    assert refused.value.tp == 3
