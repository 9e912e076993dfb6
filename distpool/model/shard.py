"""What one rank of a tensor-parallel group holds: `shard(spec, tp, rank)` from the spec's rules.

`check_tp(spec, tp)` refuses a TP size some rule cannot meet (a `TpUnshardable` naming the
units, their count and the TP sizes that work). `shard` gives the rank its spec (the shapes its own
pool stores, so sizing and the arena work unchanged) and, per tensor, the pieces of the unsharded
tensor it holds: what the transfer plan maps between two TP layouts and what the synthetic cache's
pattern is laid over. Every rank of one TP size stores the same shapes; only the pieces differ.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from distpool.facts import Facts
from distpool.model.dtypes import dtype_bytes
from distpool.model.shard_rule import ShardTable, TensorRule
from distpool.model.spec import ModelSpec

MAX_LISTED_TP = 64  # refusals list the TP sizes up to this that would work


class TpUnshardable(Facts, ValueError):
    """`tp` ranks cannot each hold a shard of every cached tensor of a model (`architectures`): its
    `count` `unit` (e.g. 6 "query heads"; count None: `unit` names a state tensor no shard rule is
    known for) do not split; `reason` says so in a sentence; `valid_sizes`: the TP sizes up to
    MAX_LISTED_TP that can."""

    def __init__(
        self,
        tp: int,
        architectures: str,
        reason: str,
        valid_sizes: tuple[int, ...],
        unit: str = "",
        count: int | None = None,
    ) -> None:
        super().__init__(f"tensor parallelism of {tp} ranks cannot shard {architectures}: {reason}")
        self.tp, self.architectures, self.reason, self.valid_sizes = tp, architectures, reason, valid_sizes
        self.unit, self.count = unit, count


class ShardArgInvalid(Facts, ValueError):
    """A TP size or rank (`field`: "tp" or "rank") of `value`, where it must be `expected`."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        super().__init__(f"{field} must be {expected}; got {value!r}")
        self.field, self.value, self.expected = field, value, expected


@dataclass(frozen=True)
class TensorShard:
    """One rank's part of one cached tensor: `pieces` of the unsharded shard axis, in its order.

    A row is what `shape` describes: one token's K or V, or one request's state tensor. The
    rank's row is its pieces laid end to end along the axis (every other dim whole)."""

    name: str
    shape: tuple[int, ...]  # the unsharded row
    dtype: str
    axis: int
    pieces: tuple[tuple[int, int], ...]  # [start, stop) along `axis` of the unsharded row

    @property
    def local_shape(self) -> tuple[int, ...]:
        held = sum(stop - start for start, stop in self.pieces)
        return (*self.shape[: self.axis], held, *self.shape[self.axis + 1 :])

    @property
    def row_bytes(self) -> int:
        """Bytes of the unsharded row."""
        return math.prod(self.shape) * dtype_bytes(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the rank's row."""
        return math.prod(self.local_shape) * dtype_bytes(self.dtype)

    @property
    def inner_bytes(self) -> int:
        """Bytes of one element of the axis (every dim after it)."""
        return math.prod(self.shape[self.axis + 1 :]) * dtype_bytes(self.dtype)

    def byte_pieces(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) byte ranges of the unsharded row the rank's row holds, in its order (which
        is increasing), neighbours merged."""
        if self.nbytes == 0:
            return ()
        axis_bytes, inner = self.shape[self.axis] * self.inner_bytes, self.inner_bytes
        ranges: list[tuple[int, int]] = []
        for outer in range(math.prod(self.shape[: self.axis])):
            for start, stop in self.pieces:
                begin, end = outer * axis_bytes + start * inner, outer * axis_bytes + stop * inner
                if ranges and ranges[-1][1] == begin:
                    ranges[-1] = (ranges[-1][0], end)
                else:
                    ranges.append((begin, end))
        return tuple(ranges)


@dataclass(frozen=True)
class RankShard:
    """Rank `rank` of a `tp`-rank group: its spec and its piece of every cached tensor.

    `spec` stores the rank's shapes (KV heads, state shapes) with the model's layer lists, dtypes
    and compute fields; `model` is the unsharded spec. `replicated` names the parts every rank of
    this TP size keeps whole copies of (e.g. "conv.B", "conv.C" of a Mamba2 conv with fewer
    groups than ranks; "k", "v" with fewer KV heads than ranks)."""

    tp: int
    rank: int
    model: ModelSpec
    spec: ModelSpec
    tensors: tuple[TensorShard, ...]
    replicated: tuple[str, ...]

    def tensor(self, name: str) -> TensorShard:
        for tensor in self.tensors:
            if tensor.name == name:
                return tensor
        raise KeyError(f"no cached tensor {name!r}; tensors: {[t.name for t in self.tensors]}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every attention layer (full and sliding window) on this rank."""
        return self.spec.full_kv_bytes_per_token + self.spec.swa_kv_bytes_per_token

    @property
    def slot_bytes(self) -> int:
        return self.spec.slot_bytes


def _arch(spec: ModelSpec) -> str:
    return ", ".join(spec.architectures) or spec.model_type or "this model"


def _refusal(table: ShardTable, tp: int) -> tuple[str, int | None, str] | None:
    """(unit, count, why) when `tp` ranks cannot hold the table: the units, their count and where
    they are; count None for a state tensor without a rule (unit: its name)."""
    if tp == 1:
        return None  # one rank holds everything, with or without rules
    for unit, count in table.split_counts:
        if count % tp:
            return unit, count, f"its {count} {unit} do not divide by {tp}"
    for tensor in table.tensors:
        if tensor.rule is None:
            why = f"no shard rule is known for its state tensor {tensor.name} {tensor.shape}"
            return tensor.name, None, why
        for segment in tensor.rule.segments:
            if segment.splits(tp):
                continue
            where = _places(table, segment.unit, segment.count)
            its = f"its {segment.count} {segment.unit} ({where})"
            if segment.replicable:
                copies = "(ranks split them, or each keeps a copy of the one its heads use)"
                return segment.unit, segment.count, f"{its} neither divide by {tp} nor divide {tp} {copies}"
            return segment.unit, segment.count, f"{its} do not divide by {tp}"
    return None


def _places(table: ShardTable, unit: str, count: int) -> str:
    """Every tensor part made of `count` `unit`s: "conv.x, ssm"."""
    parts = [
        t.part_name(s)
        for t in table.tensors
        if t.rule is not None
        for s in t.rule.segments
        if (s.unit, s.count) == (unit, count)
    ]
    return ", ".join(dict.fromkeys(parts))


def valid_tp_sizes(spec: ModelSpec, up_to: int = MAX_LISTED_TP) -> list[int]:
    """Every TP size from 1 to `up_to` that every rule of `spec` meets."""
    table = spec.shard_table
    return [tp for tp in range(1, up_to + 1) if _refusal(table, tp) is None]


def check_tp(spec: ModelSpec, tp: int) -> None:
    """Raise `TpUnshardable` (the units, their count, the TP sizes that work) unless `tp` ranks can
    each hold a shard of every cached tensor of `spec`."""
    if type(tp) is not int or tp < 1:
        raise ShardArgInvalid("tp", tp, "a positive integer")
    refusal = _refusal(spec.shard_table, tp)
    if refusal is not None:
        unit, count, reason = refusal
        raise TpUnshardable(tp, _arch(spec), reason, tuple(valid_tp_sizes(spec)), unit, count)


def replicated_parts(spec: ModelSpec, tp: int) -> tuple[str, ...]:
    """The tensor parts every rank of `tp` keeps whole copies of (`check_tp` must pass)."""
    return tuple(
        dict.fromkeys(
            t.part_name(s)
            for t in spec.shard_table.tensors
            if t.rule
            for s in t.rule.segments
            if s.replicated_at(tp)
        )
    )


def _tensor_shard(tensor: TensorRule, tp: int, rank: int) -> TensorShard:
    rule = tensor.rule
    if tp == 1:  # the whole tensor, whatever its rule
        axis = 0 if rule is None else rule.axis
        pieces = ((0, tensor.shape[axis]),)
    else:
        if rule is None or rule.axis_length != tensor.shape[rule.axis]:
            raise ValueError(f"{tensor} breaks its shard rule: its shard axis is not the rule's length")
        axis, pieces = rule.axis, rule.pieces(tp, rank)
    return TensorShard(name=tensor.name, shape=tensor.shape, dtype=tensor.dtype, axis=axis, pieces=pieces)


def _rank_spec(spec: ModelSpec, tp: int, shards: dict[str, TensorShard]) -> ModelSpec:
    """`spec` with the shapes one rank stores (every rank of `tp` stores the same)."""
    full, swa, mamba = spec.full_attention, spec.sliding_attention, spec.mamba
    if full is not None:
        full = dataclasses.replace(full, num_kv_heads=shards["k"].local_shape[0])
    if swa is not None:
        swa = dataclasses.replace(swa, num_kv_heads=shards["swa_k"].local_shape[0])
    if mamba is not None:
        mamba = dataclasses.replace(
            mamba,
            tensors=tuple(dataclasses.replace(t, shape=shards[t.name].local_shape) for t in mamba.tensors),
            shard_rules=tuple(rule.local(tp) for rule in mamba.shard_rules),
        )
    return dataclasses.replace(spec, full_attention=full, sliding_attention=swa, mamba=mamba)


def shard(spec: ModelSpec, tp: int, rank: int) -> RankShard:
    """What rank `rank` of a `tp`-rank group holds of every cached tensor of `spec`.

    Refuses (`check_tp`) a TP size the rules cannot meet; at TP 1 the rank's spec is `spec` itself.
    Shard the spec with the run's dtypes (`ModelSpec.with_dtypes`): the rank's pool and the transfer
    plan both read their byte sizes from the rank's spec.
    """
    check_tp(spec, tp)
    if type(rank) is not int or not 0 <= rank < tp:
        raise ShardArgInvalid("rank", rank, f"in 0..{tp - 1} for TP {tp}")
    table = spec.shard_table
    tensors = tuple(_tensor_shard(t, tp, rank) for t in table.tensors)
    rank_spec = spec if tp == 1 else _rank_spec(spec, tp, {t.name: t for t in tensors})
    return RankShard(
        tp=tp, rank=rank, model=spec, spec=rank_spec, tensors=tensors, replicated=replicated_parts(spec, tp)
    )
