"""What sizing refuses, as facts: the field, the value, the limit. The command line turns them into
sentences with its flag names and the fix (`distpool.cli.errors`); `str()` of each states the facts
in sizing's own words, for anyone else who catches them.
"""

from __future__ import annotations

from dataclasses import dataclass

from distpool.facts import Facts

# Why unified memory is refused (`UnifiedMemoryRefused.reason`).
DEEPSEEK_V4_POOLS = "deepseek_v4_pools"  # DeepSeek-V4 keeps its own pools, never unified
NOT_HYBRID = "not_hybrid"  # one kind of per-request memory: nothing to share an arena with
SWA_UNDER_PD = "swa_under_pd"  # no whole-envelope transfer scheme for the sliding-window band


class PoolArgInvalid(Facts, ValueError):
    """`PoolArgs.field` holds `value`; it must be `expected` (e.g. ">= 1", "in (0, 1)")."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        super().__init__(f"PoolArgs.{field} must be {expected}; got {value!r}")
        self.field, self.value, self.expected = field, value, expected


class UnifiedMemoryRefused(Facts, ValueError):
    """Unified memory asked for a model (`architectures`, of `kind`) where it cannot mean anything safe:
    `reason` is one of DEEPSEEK_V4_POOLS, NOT_HYBRID, SWA_UNDER_PD (with `disaggregation_mode`)."""

    def __init__(self, reason: str, architectures: str, kind: str, disaggregation_mode: str | None) -> None:
        super().__init__(
            f"unified memory refused for {architectures} ({kind}, disaggregation mode "
            f"{disaggregation_mode}): {reason}"
        )
        self.reason, self.architectures, self.kind = reason, architectures, kind
        self.disaggregation_mode = disaggregation_mode


@dataclass(frozen=True)
class RequestNeeds:
    """What one request of `context_len` tokens of a model (`architectures`) needs, in bytes."""

    architectures: str
    context_len: int
    needed_bytes: int  # the whole request: its slot and its pages, aligned
    slot_bytes: int  # its state slot (unpadded; 0 without recurrent state)
    kv_bytes_per_token: int  # full-attention KV per token (unpadded)


class BudgetTooSmall(Facts, ValueError):
    """A budget of `budget_bytes` cannot hold one request (`needs`). `split`: None when the whole
    budget cannot; "state/KV" or "full/SWA" when the static split of it leaves one pool too small."""

    def __init__(self, needs: RequestNeeds, budget_bytes: int, split: str | None = None) -> None:
        where = "the memory budget" if split is None else f"the static {split} split of the memory budget"
        super().__init__(
            f"{where} of {budget_bytes} bytes cannot hold one request of {needs.architectures} of "
            f"{needs.context_len} tokens ({needs.needed_bytes} bytes)"
        )
        self.needs, self.budget_bytes, self.split = needs, budget_bytes, split
