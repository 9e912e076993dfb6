"""How a tensor-parallel (TP) group splits one cached tensor: rules as data, one per tensor.

A rule cuts one axis of a tensor into segments laid end to end, each counted in its own units:

    Mamba2 conv state (conv_dim, kernel - 1), axis 0:
        | x: Mamba heads x head_dim | B: groups x d_state | C: groups x d_state |

Each segment splits on its own. With `count % tp == 0` rank r holds units
[r * count / tp, (r + 1) * count / tp). A `replicable` segment with fewer units than ranks
(`tp % count == 0`) is replicated: rank r holds the one unit its heads use, r // (tp / count),
because heads split contiguously and unit u serves heads [u * H / count, (u + 1) * H / count).
Anything else cannot shard. A rank's piece of a tensor is its pieces of every segment, in segment
order. The rules never branch on an architecture: `hf_state` writes them beside the shapes it reads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """A run of `count` units of `width` elements each along a tensor's shard axis."""

    name: str  # "x", "B", "C", "q", "k", "v", "heads", "channels"
    unit: str  # what a unit is, as a refusal names it: "Mamba heads", "groups", "KV heads", ...
    count: int
    width: int
    replicable: bool = False  # fewer units than ranks: replicated (needs tp % count == 0)

    @property
    def length(self) -> int:
        """Elements of the axis the segment spans."""
        return self.count * self.width

    def splits(self, tp: int) -> bool:
        """Whether `tp` ranks can hold this segment (split, or replicated where allowed)."""
        return self.count % tp == 0 or (self.replicable and tp % self.count == 0)

    def replicated_at(self, tp: int) -> bool:
        return self.count % tp != 0

    def units_of(self, tp: int, rank: int) -> tuple[int, int]:
        """[first, last) unit rank `rank` of `tp` holds; `splits(tp)` must hold."""
        if not self.splits(tp):
            raise ValueError(
                f"TP {tp} cannot hold {self.count} units of {self.width} "
                f"({'replicable' if self.replicable else 'not replicable'})"
            )
        if self.count % tp == 0:
            per_rank = self.count // tp
            return rank * per_rank, (rank + 1) * per_rank
        unit = rank // (tp // self.count)  # the unit serving this rank's heads
        return unit, unit + 1


@dataclass(frozen=True)
class ShardRule:
    """`segments` end to end along `axis` of one tensor's shape; their lengths sum to that axis."""

    axis: int
    segments: tuple[Segment, ...]

    @property
    def axis_length(self) -> int:
        return sum(s.length for s in self.segments)

    def pieces(self, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
        """[start, stop) ranges of the unsharded axis rank `rank` holds, in the rank's own order."""
        pieces, start = [], 0
        for segment in self.segments:
            first, last = segment.units_of(tp, rank)
            pieces.append((start + first * segment.width, start + last * segment.width))
            start += segment.length
        return tuple(pieces)

    def local(self, tp: int) -> ShardRule:
        """The rule of one rank's tensor: each segment with the units one rank holds."""
        units = tuple(s.count // tp if s.count % tp == 0 else 1 for s in self.segments)
        return ShardRule(
            axis=self.axis,
            segments=tuple(
                Segment(s.name, s.unit, count=n, width=s.width, replicable=s.replicable)
                for s, n in zip(self.segments, units, strict=True)
            ),
        )


@dataclass(frozen=True)
class TensorRule:
    """One cached tensor of a model and its rule. `shape` is what one row holds: one token's
    (kv_heads, head_dim) for K and V, one request's whole state tensor for state."""

    name: str  # "k", "v", "swa_k", "swa_v", or a state tensor's name ("conv", "ssm", ...)
    shape: tuple[int, ...]
    dtype: str
    rule: ShardRule | None  # None: no rule is known; only TP 1 holds it

    def part_name(self, segment: Segment) -> str:
        """How `replicated` lists a segment: the tensor alone when it is one segment."""
        one = self.rule is not None and len(self.rule.segments) == 1
        return self.name if one else f"{self.name}.{segment.name}"


@dataclass(frozen=True)
class ShardTable:
    """Every cached tensor's rule, and counts outside the cache that every TP size must divide
    (the query heads: a rank computes attention for its own heads only)."""

    tensors: tuple[TensorRule, ...]
    split_counts: tuple[tuple[str, int], ...] = ()  # (unit, count), e.g. ("query heads", 32)
