"""The handshake: both ends of a channel describe their pool layout before a group exists.

Each end puts its hello (protocol version, backend, layout fingerprint, and the layout fields the
fingerprint covers) in the store of the new generation and reads the peer's. Any difference is
refused on both ends with `FingerprintMismatch`, naming each differing field (`layout.page_size`,
...) with both values, so the operator sees what to fix rather than a hash.

An end of a tensor-parallel group adds its TP layout (`tp`: size, rank and the unsharded model
layout; `transfer.plans.tp_handshake`). Across TP sizes the per-rank layouts differ by design, so the
unsharded layouts are compared instead, and a pair that cannot be resharded is refused with
`ReshardRefused`.
"""

from __future__ import annotations

import datetime
from typing import Any

import msgpack
import torch.distributed as dist

from distpool.memory.sizing import TpEnd
from transfer.connect import ControlAuth
from transfer.plans import check_reshard, tp_differing_fields, tp_of
from transfer.wire import PROTOCOL_VERSION, ChannelError, FingerprintMismatch, hello_key


def make_hello(*, backend: str, fingerprint: str, layout: dict[str, Any], tp: TpEnd | None = None) -> bytes:
    hello = {"protocol": PROTOCOL_VERSION, "backend": backend, "fingerprint": fingerprint, "layout": layout}
    if tp is not None:
        hello["tp"] = tp.hello()
    return msgpack.packb(hello, use_bin_type=True)


def exchange_hello(
    store: dist.Store,
    *,
    auth: ControlAuth,
    generation: int,
    rank: int,
    hello: bytes,
    timeout: datetime.timedelta,
    tp: TpEnd | None = None,
) -> dict[str, Any]:
    """Publish our hello, read the peer's (sealed under the deployment's secret); raise
    FingerprintMismatch if they differ, ReshardRefused if the two TP layouts (`tp`: ours, as in
    our hello) cannot be resharded, ChannelError if the peer's is not authentic."""
    ours_key, theirs_key = (auth.key(f"g{generation}/{hello_key(r)}") for r in (rank, 1 - rank))
    store.set(ours_key, auth.seal(ours_key, hello))
    store.wait([theirs_key], timeout)
    blob = auth.open(theirs_key, store.get(theirs_key))
    if blob is None:
        raise ChannelError(
            f"channel {auth.channel}: the peer's hello is not sealed with this deployment's secret"
        )
    try:
        theirs = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    except Exception as exc:  # sealed, so a bug on the peer rather than an outsider; still never a crash
        raise ChannelError(f"channel {auth.channel}: the peer's hello is undecodable: {exc}") from None
    ours = msgpack.unpackb(hello, raw=False, strict_map_key=False)  # the same normalisation as theirs
    differing = differing_fields(ours, theirs)
    if type(theirs) is dict:  # the TP layouts (transfer.plans.tp_handshake)
        if tp_of(ours).get("size") != tp_of(theirs).get("size"):
            # rank layouts differ across TP sizes by design: the unsharded layouts must agree instead
            differing = {k: v for k, v in differing.items() if k in ("protocol", "backend")}
        differing |= tp_differing_fields(ours, theirs)
    if differing:
        raise FingerprintMismatch(differing)
    check_reshard(tp, theirs, sending=rank == 0)
    return theirs


def differing_fields(ours: dict[str, Any], theirs: object) -> dict[str, tuple[object, object]]:
    """Each field whose value differs, as name -> (ours, theirs); layout fields as `layout.<name>`."""
    if type(theirs) is not dict:
        return {"hello": (ours, theirs)}
    differing: dict[str, tuple[object, object]] = {}
    for name in ("protocol", "backend", "fingerprint"):
        if ours.get(name) != theirs.get(name):
            differing[name] = (ours.get(name), theirs.get(name))
    our_layout, their_layout = ours.get("layout") or {}, theirs.get("layout") or {}
    if type(their_layout) is not dict:
        their_layout = {"layout": their_layout}
    for name in sorted(set(our_layout) | set(their_layout), key=str):
        if our_layout.get(name) != their_layout.get(name):
            differing[f"layout.{name}"] = (our_layout.get(name), their_layout.get(name))
    return differing
