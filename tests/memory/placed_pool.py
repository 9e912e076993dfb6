"""Pools with a chosen placement policy, and the byte counts the no-refusal-with-room rule uses."""

from __future__ import annotations

from distpool.memory.arena_pool import ArenaPool, build_pool
from distpool.model.spec import ModelSpec
from tests.factories import make_sizes


def make_placed_pool(
    spec: ModelSpec | None = None, *, placement: str = "extent", **size_args: object
) -> ArenaPool:
    """`make_pool(spec, **size_args)` whose allocator places pages by `placement`."""
    return build_pool(make_sizes(spec, **size_args), placement=placement)


def unit_bytes(pool: ArenaPool, low_units: int, pages: int) -> int:
    """Bytes of `low_units` low-band units (slots or window pages) and `pages` full pages."""
    low, high = pool.arena.low, pool.arena.high
    return (low.stride_bytes * low_units if low else 0) + (high.stride_bytes * pages if high else 0)


def free_bytes(pool: ArenaPool) -> int:
    """Arena bytes no live unit holds (holes included: compaction gathers them)."""
    usage = pool.usage()
    held = unit_bytes(pool, usage[pool.arena.low.name].held if pool.arena.low else 0, 0)
    return pool.sizes.arena_bytes - held - unit_bytes(pool, 0, usage["pages"].held if pool.arena.high else 0)
