"""The handshake's tensor-parallel part: which hello fields must agree between two TP layouts, and
whether a pair of ranks can be resharded (`distpool.memory.sizing.TpEnd` is what each end says).

A hello without a "tp" entry is rank 0 of TP 1. With equal TP sizes both ends hold the same shapes:
every field compared before TP existed must agree (and the unsharded layouts, where both ends give
one), and the pair must be ranks the plan joins (rank r sends to rank r). With different sizes the
per-rank layouts differ by design: the unsharded model layouts must agree, and the pair must be one
the plan between the two layouts uses (`transfer.plans.reshard.source_ranks`). Anything else is refused
when the channel forms, before any request, never at transfer time.
"""

from __future__ import annotations

from typing import Any

from distpool.memory.sizing import TpEnd
from distpool.model.shard import check_tp, shard
from transfer.plans.reshard import source_ranks
from transfer.wire import MALFORMED, NO_TP_LAYOUT, NOTHING_TO_MOVE, UNSHARDABLE, ReshardRefused

_ONE_RANK = {"size": 1, "rank": 0}


def tp_of(hello: dict[str, Any]) -> dict[str, Any]:
    tp = hello.get("tp")
    return tp if type(tp) is dict else _ONE_RANK


def tp_differing_fields(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple[object, object]]:
    """The unsharded layout fields that differ, as `tp.model.<field>` -> (ours, theirs). Across TP
    sizes both ends must describe one; with equal sizes the rank layouts were compared already."""
    our_tp, their_tp = tp_of(ours), tp_of(theirs)
    our_model, their_model = our_tp.get("model"), their_tp.get("model")
    if our_tp.get("size") == their_tp.get("size") and (our_model is None or their_model is None):
        return {}  # one end predates TP layouts: the rank layouts were compared, and suffice
    if type(our_model) is not dict or type(their_model) is not dict:
        return {"tp.model": (our_model, their_model)}
    return {
        f"tp.model.{name}": (our_model.get(name), their_model.get(name))
        for name in sorted(set(our_model) | set(their_model), key=str)
        if our_model.get(name) != their_model.get(name)
    }


def check_reshard(end: TpEnd | None, theirs: dict[str, Any], *, sending: bool) -> None:
    """Raise ReshardRefused unless the peer's TP layout (its hello's "tp") and ours can be resharded
    and this pair of ranks moves bytes under the plan. The models already agree."""
    peer = tp_of(theirs)
    size, rank = peer.get("size"), peer.get("rank")
    mine = (1, 0) if end is None else (end.shard.tp, end.shard.rank)
    if end is None:
        if (size, rank) != mine:
            raise ReshardRefused(NO_TP_LAYOUT, peer_rank=rank, peer_size=size)
        return
    model = end.shard.model
    if type(size) is not int or type(rank) is not int or not 0 <= rank < size:
        raise ReshardRefused(MALFORMED, peer_rank=rank, peer_size=size)
    try:
        check_tp(model, size)
    except ValueError as exc:
        raise ReshardRefused(UNSHARDABLE, peer_rank=rank, peer_size=size, cause=exc) from None
    (src_size, src_rank), (dst_size, dst_rank) = (mine, (size, rank)) if sending else ((size, rank), mine)
    src = [shard(model, src_size, r) for r in range(src_size)]
    dst = [shard(model, dst_size, r) for r in range(dst_size)]
    needed = source_ranks(src, dst, dst_rank)
    if src_rank not in needed:
        raise ReshardRefused(
            NOTHING_TO_MOVE,
            peer_rank=rank,
            peer_size=size,
            src=(src_rank, src_size),
            dst=(dst_rank, dst_size),
            needed=needed,
        )
