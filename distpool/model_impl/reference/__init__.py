"""The reference model: a small seeded hybrid model that runs on any `Pool`, and its bundled configs."""
