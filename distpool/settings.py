"""Environment variables, read here and nowhere else (never at import time elsewhere)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    ray_address: str | None  # set inside `ray job submit` and by users attaching to a cluster
    transfer_timeout_s: float  # every blocking wait of a transfer ends by then
    chunk_mib: int  # staging chunk of the transfer engine

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            ray_address=os.environ.get("RAY_ADDRESS") or None,
            transfer_timeout_s=float(os.environ.get("DISTPOOL_TRANSFER_TIMEOUT_S", "10")),
            chunk_mib=int(os.environ.get("DISTPOOL_CHUNK_MIB", "32")),
        )
