"""What computes in a pool (a `PoolModel`), side by side: transformers' modeling code of real hybrid
architectures (`hf/`), the bundled reference model (`reference/`), the synthetic, byte-verified cache
(`synthetic/`); `select` chooses one for a run and `flags` holds their command-line flags."""
