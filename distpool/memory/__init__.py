"""The memory: pool sizing, the arena's bytes, the allocator, the prefix cache, the `Pool` interface.

Bottom to top (the import contract in pyproject.toml enforces the order):
- `errors.py`, `envelope.py`: what a pool answers with when it cannot; a request's byte ranges as a
  transfer moves them;
- `sizing/`: pure sizes and byte layout from a model and a budget (and one TP rank's, and their fingerprint);
- `arena/`: the bytes, the bands of ids over them and their free runs, byte runs;
- `alloc/`: the allocator: live requests, placement, growth, shared pages, compaction;
- `prefix/`: what is kept for reuse: the prefix cache and decode's final states;
- `refusals.py`: a refused call: evict, then compact; `arena_pool.py`: the pool over all of these;
  `pool.py`: the `Pool` interface and its errors, the only part of memory that workers see.
Each subpackage's `__init__` names what the others may use.
"""
