"""The synthetic cache: any config at its true sizes, no arithmetic, every byte of an envelope
a pure function of (seed, layer, token prefix, element) and verified at decode."""
