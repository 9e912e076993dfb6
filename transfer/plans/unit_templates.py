"""Inside one unit of an envelope: which source rank sends which pieces of each tensor to one
destination rank, as runs relative to the two units' starts (the templates `transfer.plans.reshard`
shifts to every unit).

Inside a unit, a destination rank's row of each tensor is pieces of the unsharded tensor's axis;
each piece comes from a source rank holding those coordinates. A piece several source ranks hold
(a replicated part) comes from one of them: the lowest-ranked among the source ranks whose share
of the heads overlaps the destination's (the ones it receives sharded parts from anyway), else the
lowest-ranked holder.

    unit_templates(...)     -> {(source rank, unit kind): (m, 3) runs relative to the unit starts,
                                merged where they continue each other on both sides}
    source_preference(...)  -> the order a replicated piece's holders are taken in
    assign_pieces(...)      -> (source rank, start, stop) covering one tensor's pieces once
                               (`transfer.plans.reshard.source_ranks` reads these two as well)

A pure function of both layouts' `RankShard`s and the page size, cached per destination rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from distpool.memory.arena import merge_runs
from distpool.memory.sizing import TensorPlace, kv_page_shape, page_places, slot_places
from distpool.model.shard import RankShard, TensorShard

UNIT_KINDS = ("slot", "page", "swa_page")  # canonical order of an envelope's units


def _places(shard: RankShard, kind: str, page_size: int) -> dict[tuple[int, str], TensorPlace]:
    """Every tensor of one unit of `kind` on this rank, keyed (layer, tensor name)."""
    spec = shard.spec
    if kind == "slot":
        return {(p.layer, p.name): p for p in slot_places(spec)}
    if kind == "page":
        places, prefix = page_places(spec.full_attention_layers, spec.full_attention, page_size), ""
    else:
        places, prefix = page_places(spec.sliding_window_layers, spec.sliding_attention, page_size), "swa_"
    return {(p.layer, prefix + p.name): p for p in places}


def source_preference(src_tp: int, dst_tp: int, dst_rank: int) -> list[int]:
    """Source ranks in the order a replicated piece is taken from: those whose share of the heads
    overlaps the destination rank's first, then the others; each group lowest rank first."""
    overlaps = [
        s
        for s in range(src_tp)
        if s * dst_tp < (dst_rank + 1) * src_tp and dst_rank * src_tp < (s + 1) * dst_tp
    ]
    return overlaps + [s for s in range(src_tp) if s not in overlaps]


def assign_pieces(
    dst: TensorShard, sources: Sequence[TensorShard], order: list[int]
) -> list[tuple[int, int, int]]:
    """(source rank, start, stop) along the axis covering each of `dst`'s pieces once, in its order."""
    assigned = []
    for start, stop in dst.pieces:
        todo = [(start, stop)]
        for rank in order:
            for a, b in sources[rank].pieces:
                left = []
                for lo, hi in todo:
                    x, y = max(lo, a), min(hi, b)
                    if x >= y:
                        left.append((lo, hi))
                        continue
                    assigned.append((rank, x, y))
                    left += [(lo, x)] if lo < x else []
                    left += [(y, hi)] if y < hi else []
                todo = left
        if todo:
            raise ValueError(
                f"no source rank holds [{todo[0][0]}, {todo[0][1]}) of {dst.name}'s axis {dst.axis}: the "
                "source layout does not cover the tensor"
            )
    return sorted(assigned, key=lambda piece: piece[1])


def _local(pieces: tuple[tuple[int, int], ...], position: int) -> int:
    """Where unsharded axis index `position` (held by the rank) sits on the rank's axis."""
    at = 0
    for start, stop in pieces:
        if start <= position < stop:
            return at + position - start
        at += stop - start
    raise AssertionError(f"{position} is not in {pieces}")


def _in_page(tensor: TensorShard, page_size: int) -> TensorShard:
    """K's or V's shard as one page holds it: (kv_heads, page_size, dim) (`KV_ORDER`), split by heads,
    so a rank's heads are one run of the page's tensor."""
    if tensor.axis != 0:
        raise ValueError(f"{tensor.name} is split along axis {tensor.axis}; a page keeps KV heads outermost")
    return dataclasses.replace(tensor, shape=kv_page_shape(tensor.shape, page_size))


def _tensor_runs(
    src: TensorShard, dst: TensorShard, src_at: TensorPlace, dst_at: TensorPlace, a: int, b: int
) -> np.ndarray:
    """Runs, relative to the two units' starts, moving axis [a, b) of every row of one tensor."""
    inner = src.inner_bytes
    rows = math.prod(src.shape[: src.axis])
    src_row, dst_row = src.local_shape[src.axis] * inner, dst.local_shape[dst.axis] * inner
    if src_at.nbytes != rows * src_row or dst_at.nbytes != rows * dst_row:
        raise ValueError("a shard breaks its rank's layout")
    if src_at.row_stride is not None or dst_at.row_stride is not None:
        # A slot's state, its rows `row_stride` apart (`SLOT_ORDER`): one run per row of [a, b)
        if src.axis != 0:
            raise ValueError(
                f"{src.name} is split along axis {src.axis}; a slot keeps the first one outermost"
            )
        index = np.arange(b - a, dtype=np.int64)
        return np.stack(
            [
                src_at.offset + (_local(src.pieces, a) + index) * (src_at.row_stride or inner),
                dst_at.offset + (_local(dst.pieces, a) + index) * (dst_at.row_stride or inner),
                np.full(b - a, inner, dtype=np.int64),
            ],
            axis=1,
        )
    r = np.arange(rows, dtype=np.int64)
    return np.stack(
        [
            src_at.offset + r * src_row + _local(src.pieces, a) * inner,
            dst_at.offset + r * dst_row + _local(dst.pieces, a) * inner,
            np.full(rows, (b - a) * inner, dtype=np.int64),
        ],
        axis=1,
    )


@lru_cache(maxsize=64)  # one per (layouts, destination rank) a worker meets; requests reuse them
def unit_templates(
    src_shards: tuple[RankShard, ...], dst: RankShard, page_size: int
) -> dict[tuple[int, str], np.ndarray]:
    """Per (source rank, unit kind): runs relative to unit starts, in destination order (read only)."""
    order = source_preference(len(src_shards), dst.tp, dst.rank)
    parts: dict[tuple[int, str], list[np.ndarray]] = {}
    for kind in UNIT_KINDS:
        src_places = [_places(s, kind, page_size) for s in src_shards]
        expected = 0
        for (layer, name), dst_at in _places(dst, kind, page_size).items():
            if dst_at.nbytes == 0:
                continue  # MLA's V: nothing cached
            expected += dst_at.nbytes
            sources, target = [s.tensor(name) for s in src_shards], dst.tensor(name)
            if kind != "slot":
                sources, target = [_in_page(s, page_size) for s in sources], _in_page(target, page_size)
            for rank, a, b in assign_pieces(target, sources, order):
                runs = _tensor_runs(sources[rank], target, src_places[rank][layer, name], dst_at, a, b)
                parts.setdefault((rank, kind), []).append(runs)
        moved = sum(int(r[:, 2].sum()) for (_, k), rs in parts.items() if k == kind for r in rs)
        if moved != expected:
            raise ValueError(f"{kind}: rank {dst.rank} would receive {moved} of its {expected} bytes")
    templates = {}
    for key, runs in parts.items():
        table = np.concatenate(runs)
        table = table[np.argsort(table[:, 1], kind="stable")]
        templates[key] = merge_runs(table[:, 0], table[:, 1], table[:, 2])  # merged inside the unit
        templates[key].flags.writeable = False
    return templates
