"""Which fault, if any, the driver injects into one attempt (`--fault-rate`, `scripts/soak.py`)."""

from __future__ import annotations

import random
from collections import Counter

from transfer.faults import RECEIVER_FAULTS, SENDER_FAULTS

RECEIVER_CANCEL = "receiver_cancel"  # the driver has decode give the request up mid-transfer
# `corrupt_payload` on one rank of a decode TP group only (its last): the other ranks' shards land
# intact, so the ranks disagree on whether the envelope verified (at TP 1, corrupt_payload itself)
CORRUPT_ONE_RANK = "corrupt_one_rank"
DRIVER_FAULTS = (RECEIVER_CANCEL, CORRUPT_ONE_RANK)
ALL_FAULTS = (*SENDER_FAULTS, *RECEIVER_FAULTS, *DRIVER_FAULTS)


class FaultPlan:
    """`rates` maps a fault kind to its probability per attempt (their sum at most 1); seeded."""

    def __init__(self, rates: dict[str, float], seed: int = 0) -> None:
        unknown = sorted(set(rates) - set(ALL_FAULTS))
        if unknown or not all(0.0 <= p < 1.0 for p in rates.values()) or sum(rates.values()) >= 1.0:
            raise ValueError(
                f"fault rates must be kinds among {', '.join(ALL_FAULTS)} with probabilities summing "
                f"below 1; got {rates}"
            )
        self.rates = {kind: p for kind, p in rates.items() if p > 0}
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()  # drawn for an attempt
        # Planned on workers and taken by a transfer there; an attempt that ends before its
        # transfer (no room: tried again later) leaves its plan untaken.
        self.struck: Counter[str] = Counter()

    def draw(self) -> str | None:
        """The fault for the next attempt, or None (counted when drawn)."""
        if not self.rates:
            return None
        u, total = self.rng.random(), 0.0
        for kind, p in self.rates.items():
            total += p
            if u < total:
                self.injected[kind] += 1
                return kind
        return None
