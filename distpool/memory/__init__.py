"""The memory: pool sizing, byte layout, the arena and its allocator, the `Pool` interface, envelopes."""
