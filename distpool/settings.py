"""Environment variables, read here and nowhere else (only by the command line, never at import time).

Unset variables are None: the defaults live with what they configure (`TransferOptions`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    ray_address: str | None  # set inside `ray job submit` and by users attaching to a cluster
    transfer_timeout_s: float | None  # DISTPOOL_TRANSFER_TIMEOUT_S: every blocking wait of a transfer
    chunk_mib: int | None  # DISTPOOL_CHUNK_MIB: staging chunk of the transfer engine
    api_key: str | None = None  # DISTPOOL_API_KEY: the bearer token `distpool serve` asks for

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        """Raises ValueError naming the variable for a value that is not a number."""
        return cls(
            ray_address=env.get("RAY_ADDRESS") or None,
            transfer_timeout_s=_number(env, "DISTPOOL_TRANSFER_TIMEOUT_S", float),
            chunk_mib=_number(env, "DISTPOOL_CHUNK_MIB", int),
            api_key=env.get("DISTPOOL_API_KEY") or None,
        )


def _number(env: Mapping[str, str], name: str, kind: type) -> float | int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None
