"""Channels between ranks of two TP layouts: a pair the plan uses connects; a pair that cannot be
resharded, or that the plan never uses, is refused on both ends when the channel forms."""

from __future__ import annotations

import pickle

import pytest

from distpool.memory.sizing import TpEnd, layout_description, layout_fingerprint
from distpool.model.shard import TpUnshardable, shard
from tests.factories import make_sizes, tp_spec
from tests.transfer.test_channel import connect_both, make_channel
from tests.transfer.transfer_peer import free_port
from transfer import Channel, FingerprintMismatch, ReshardRefused
from transfer.plans.tp_handshake import check_reshard
from transfer.wire import MALFORMED, NO_TP_LAYOUT, NOTHING_TO_MOVE, UNSHARDABLE


def tp_end(model: str, tp: int, rank: int, **size_args) -> tuple[TpEnd, dict, str]:
    """A rank's TP layout with its pool's layout description and fingerprint."""
    rank_shard = shard(tp_spec(model), tp, rank)
    sizes = make_sizes(rank_shard.spec, budget_bytes=64 << 10, context_len=32, **size_args)
    return TpEnd.of(sizes, rank_shard), layout_description(sizes), layout_fingerprint(sizes)


def connect(src: tuple, dst: tuple) -> tuple[Channel, Channel, tuple]:
    port = free_port()
    sender, receiver = (
        make_channel(role, port, tp=tp, layout=layout, fingerprint=fingerprint, name="tp")
        for role, (tp, layout, fingerprint) in enumerate((src, dst))
    )
    return sender, receiver, connect_both(sender, receiver)


def test_a_pair_the_plan_uses_connects_across_tp_sizes():
    sender, receiver, errors = connect(tp_end("mamba2_groups1", 2, 1), tp_end("mamba2_groups1", 1, 0))
    assert errors == (None, None)
    assert receiver.peer_hello["tp"]["size"] == 2 and sender.peer_hello["tp"]["size"] == 1
    sender.close()
    receiver.close()


def test_a_pair_the_plan_never_uses_is_refused_on_both_ends_before_any_request():
    """Decode rank 0 of TP 4 takes its quarter of the heads, and the one group, from prefill rank 0."""
    sender, receiver, errors = connect(tp_end("mamba2_groups1", 2, 1), tp_end("mamba2_groups1", 4, 0))
    for error in errors:
        assert isinstance(error, ReshardRefused)
        assert (error.problem, error.src, error.dst, error.needed) == (NOTHING_TO_MOVE, (1, 2), (0, 4), (0,))
    assert not sender.healthy and not receiver.healthy
    sender.close()
    receiver.close()


def test_different_models_across_tp_sizes_are_refused_naming_the_tensor_and_sizes():
    sender, receiver, errors = connect(tp_end("mamba2_groups8", 2, 0), tp_end("mamba2_groups1", 1, 0))
    for error in errors:
        assert isinstance(error, FingerprintMismatch)
        assert {"tp.model.mamba", "tp.model.shard_table"} <= set(error.fields)
        assert "fingerprint" not in error.fields  # rank layouts differ across TP sizes by design
    ours, theirs = errors[0].fields["tp.model.mamba"]
    assert [t["shape"] for t in ours["tensors"]] == [[160, 3], [8, 4, 8]]  # conv: x | 8 groups of B, C
    assert [t["shape"] for t in theirs["tensors"]] == [[48, 3], [8, 4, 8]]  # one group
    sender.close()
    receiver.close()


def hello_of(end: tuple) -> dict:
    return {"tp": end[0].hello()}


@pytest.mark.parametrize(
    "peer,sending,problem",
    [
        ({"size": 3, "rank": 0}, True, UNSHARDABLE),
        ({"size": 2, "rank": 2}, True, MALFORMED),
        ({"size": 2, "rank": 1}, False, NOTHING_TO_MOVE),
    ],
    ids=["cannot-shard", "no-such-rank", "equal-tp-other-rank"],
)
def test_check_reshard_names_what_cannot_pair(peer, sending, problem):
    ours = tp_end("mamba2_groups1", 2, 0)[0]
    with pytest.raises(ReshardRefused) as refused:
        check_reshard(ours, {"tp": peer}, sending=sending)
    error = refused.value
    assert (error.problem, error.peer_rank, error.peer_size) == (problem, peer["rank"], peer["size"])
    if problem == UNSHARDABLE:  # its 8 query heads do not divide by 3
        assert isinstance(error.cause, TpUnshardable) and error.cause.tp == 3
    if problem == NOTHING_TO_MOVE:
        assert (error.src, error.dst, error.needed) == ((1, 2), (0, 2), (0,))
    again = pickle.loads(pickle.dumps(error))  # Ray carries it with its facts
    assert (type(again), again.problem, again.src, str(again)) == (
        ReshardRefused,
        problem,
        error.src,
        str(error),
    )


def test_one_rank_ends_without_tp_layouts_pair_as_they_always_did():
    check_reshard(None, {}, sending=True)
    check_reshard(tp_end("gdn_kv2", 1, 0)[0], {}, sending=False)
    with pytest.raises(ReshardRefused) as refused:
        check_reshard(None, hello_of(tp_end("gdn_kv2", 2, 1)), sending=False)
    assert (refused.value.problem, refused.value.peer_rank, refused.value.peer_size) == (NO_TP_LAYOUT, 1, 2)
