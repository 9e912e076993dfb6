"""The pool classes offer every call of the Pool interface that workers and the engine use."""

import inspect

from distpool.pool import Pool
from distpool.pools import ArenaPool


def test_arena_pool_implements_the_whole_pool_interface():
    wanted = {n for n, _ in inspect.getmembers(Pool, inspect.isfunction) if not n.startswith("_")}
    assert wanted >= {"reserve", "extend_batch", "envelope_ranges", "pin", "compact", "stats"}
    assert sorted(n for n in wanted if not callable(getattr(ArenaPool, n, None))) == []
