"""What computes in a pool (a `PoolModel`), side by side: the bundled reference model (`reference/`),
the synthetic, byte-verified cache (`synthetic/`); `select` chooses one for a run."""
